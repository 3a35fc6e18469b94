"""Peak memory of one multiple-choice evaluation whose log-likelihood accuracy reads generation's first-step logits
(``runtime.generation.generate``'s ``first_logits``): copied from the first step (the default where the model's
generation config adds no logits processor) or, with ``--keep-every-step``, read from ``output_logits``, for which
transformers keeps every step's ``[B, V]`` float32 logits until the batch ends (the way before 2026-11-29).

The model: random weights, 2 layers, 64 wide, with Qwen2.5-Coder-1.5B's tokenizer and 151,936-token vocabulary, so
every answer runs to the token budget (the worst case) and the logits, not the model, are what the memory holds.
ARC-Challenge, fp32, one process per measurement (``peak_rss_mb`` after ``reset_peak``):

    .venv/bin/python scripts/first_logits_memory.py                      # copied from the first step
    .venv/bin/python scripts/first_logits_memory.py --keep-every-step    # every step's logits kept

``--qwen-from DIR``: a folder with Qwen2.5-Coder-1.5B's config.json and tokenizer (default: the newest cached
export; ``fedspear models install qwen2.5-coder-1.5b`` makes one).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keep-every-step", action="store_true", help="read the first logits from output_logits")
    p.add_argument("--qwen-from", help="a folder with Qwen2.5-Coder-1.5B's config.json and tokenizer files")
    p.add_argument("--items", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=256)
    args = p.parse_args()

    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from fedspear.evaluation import evaluate
    from fedspear.runtime import generation
    from fedspear.runtime.memory import peak_rss_mb, reset_peak
    from fedspear.runtime.model import LoraSettings, add_lora
    from fedspear.runtime.model_zoo import cache_root
    from fedspear.tasks import arc_challenge

    if args.qwen_from:
        source = Path(args.qwen_from)
    else:
        cached = sorted(cache_root().glob("models/qwen2.5-coder-1.5b-*/config.json"), key=lambda f: f.stat().st_mtime)
        if not cached:
            raise SystemExit("no Qwen2.5-Coder-1.5B export: run `fedspear models install qwen2.5-coder-1.5b`, "
                             "or pass --qwen-from")
        source = cached[-1].parent
    if args.keep_every_step:
        generation.first_processor_sees_raw_logits = lambda model: False
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = Qwen2Config.from_pretrained(source)
    config.num_hidden_layers, config.hidden_size, config.intermediate_size = 2, 64, 128
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 16
    config.layer_types = config.layer_types[:2]
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(config)
    base.generation_config.pad_token_id = tokenizer.pad_token_id
    model = add_lora(base, LoraSettings())
    items = arc_challenge.load("test")[: args.items]
    evaluate(model, tokenizer, items[:4], arc_challenge, batch_size=4, max_new_tokens=8)  # warm-up
    reset_peak()
    start_mb = peak_rss_mb()
    answers: list = []
    t0 = time.perf_counter()
    out = evaluate(model, tokenizer, items, arc_challenge, batch_size=args.batch_size,
                   max_new_tokens=args.max_new_tokens, answers=answers)
    way = "every step's logits kept" if args.keep_every_step else "first step copied"
    print(f"{way}: peak resident {peak_rss_mb():.0f} MiB (at the start {start_mb:.0f}), evaluation "
          f"{time.perf_counter() - t0:.1f} s; {len(items)} items at batch {args.batch_size}, longest answer "
          f"{max(a['tokens'] for a in answers)} tokens, vocabulary {config.vocab_size}; acc_ll {out['acc_ll']:.4f}, "
          f"acc_gen {out['acc_gen']:.4f}")


if __name__ == "__main__":
    main()
