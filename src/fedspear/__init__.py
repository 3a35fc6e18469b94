"""fedspear: online federated fine-tuning of LLMs from real-time user feedback (SPEAR, arXiv 2605.07977)."""

import warnings

__version__ = "0.1.0"

# Third-party deprecation notices a fedspear user can do nothing about, silenced by their exact text (every other
# warning still shows). Each names what emits it; drop an entry when the pinned versions stop emitting it.
KNOWN_WARNINGS = (
    # peft reads `model.is_gradient_checkpointing` when it wraps a model (peft/peft_model.py); transformers 5 renamed it
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
    # ray.init (ray/_private/worker.py) on every simulation: fedspear's clients use no GPU through Ray (num_gpus = 0)
    (FutureWarning, r"Tip: In future versions of Ray, Ray will no longer override accelerator visible devices"),
)
for _category, _message in KNOWN_WARNINGS:
    warnings.filterwarnings("ignore", message=_message, category=_category)
