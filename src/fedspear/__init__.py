"""fedspear: online federated fine-tuning of LLMs from real-time user feedback (SPEAR, arXiv 2605.07977)."""

__version__ = "0.1.0"
