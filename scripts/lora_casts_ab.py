"""A LoRA adapter's input cast (peft's ``cast_input_dtype_enabled``) on and off, in one process: prefill and training
throughput over bf16 weights under bf16 autocast, where peft's cast makes an fp32 copy of each adapted projection's
input that autocast casts back to bf16 (``fedspear.runtime.model.bf16_lora_inputs``, which turns it off).

Prefill (a forward over ``--batch × --length`` tokens, logits at the last position) and training (forward + backward,
logits for the last 16 positions, dropout as configured) are timed by ``fedspear bench``'s own functions; medians of
``--repeats`` alternating pairs, and whether the two ways give the same prefill logits (bit for bit).

    .venv/bin/python scripts/lora_casts_ab.py [--model smollm2-135m] [--device cpu|cuda] [--batch 32 --length 220]
        [--seconds 1.5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from fedspear.experiments.bench import prefill_tokens_per_s, train_tokens_per_s
from fedspear.runtime.model import LoraSettings, add_lora, autocast, load_base, model_device


def casting(model, enabled: bool) -> int:
    """Set peft's input cast on every LoRA layer of ``model``; returns how many layers."""
    layers = [m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled")]
    for layer in layers:
        layer.cast_input_dtype_enabled = enabled
    return len(layers)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=220)
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args()
    torch.manual_seed(0)
    base, _, dtype_used = load_base(args.model, "auto", args.device)
    model = add_lora(base, LoraSettings(), seed=0)
    for name, param in model.named_parameters():  # a trained-looking adapter, so its branch changes the outputs
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.01)
    device = model_device(model)
    ids = torch.randint(100, 1000, (args.batch, args.length), device=device)
    arms = {"peft's cast": True, "no cast": False}
    logits, times = {}, {arm: {"prefill": [], "train": []} for arm in arms}
    for arm, enabled in arms.items():
        layers = casting(model, enabled)
        model.eval()
        with torch.no_grad(), autocast(dtype_used, device.type):
            logits[arm] = model(input_ids=ids, logits_to_keep=1).logits
    for rep in range(args.repeats):
        for arm, enabled in (arms.items() if rep % 2 == 0 else reversed(arms.items())):
            casting(model, enabled)
            times[arm]["prefill"].append(prefill_tokens_per_s(model, dtype_used, args.batch, args.length, args.seconds))
            times[arm]["train"].append(train_tokens_per_s(model, dtype_used, args.batch, args.length, args.seconds))
        print(f"pair {rep + 1}: " + "; ".join(f"{arm} prefill {t['prefill'][-1]:.0f}, train {t['train'][-1]:.0f}"
                                               for arm, t in times.items()) + " tokens/s", flush=True)
    out = {"model": args.model, "device": str(device), "dtype": dtype_used, "lora_layers": layers,
           "weights": str({p.dtype for n, p in model.named_parameters() if "lora_" not in n}),
           "batch": args.batch, "length": args.length, "repeats": args.repeats,
           "same_prefill_logits": bool(torch.equal(*logits.values())),
           "tokens_per_s": {arm: {k: statistics.median(v) for k, v in t.items()} for arm, t in times.items()}}
    for what in ("prefill", "train"):
        before, after = (out["tokens_per_s"][arm][what] for arm in arms)
        print(f"{what}: {before:.0f} → {after:.0f} tokens/s ({after / before:.3f}×)")
    print(f"same prefill logits: {out['same_prefill_logits']}; {layers} LoRA layers; {dtype_used} on {device}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
