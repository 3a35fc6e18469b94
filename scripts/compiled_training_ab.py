"""A LoRA training micro-step with the model's forward compiled (``compile_training = on``,
``fedspear.runtime.compiled_training``) and eager, in one process: what the compilation costs, what a warm step gains,
and whether the gradients agree.

A micro-step is the runs' own path — traces packed (``training.pack``), ``training.completion_logprobs`` (logits at
the completion window only), a loss over them and its backward into the LoRA parameters — at ``--batch`` rows of
``--length`` tokens with a ``--window``-token completion, the adapter's dropout as configured. Reported:

- ``compile_s``: the first compiled micro-step (compilation included), and the first one of a second shape
  (a quarter fewer rows, an eighth fewer tokens, a window half as long again): no new compilation expected
  (``graphs``: the graphs compiled for the training forward, counted by dynamo);
- tokens/s of warm micro-steps, compiled and eager, medians of ``--repeats`` alternating pairs, and each as a share
  of the matmul bound (``fedspear bench``'s FLOP count, ``train_flops``, and the bf16 or fp32 matmul rate measured
  here at the bench's size);
- ``gradients``: with dropout off, the compiled step's loss and LoRA gradients against the eager step's: the norm of
  their difference over the norm of the eager ones, and the largest element difference relative to its tensor's
  largest eager entry. In bf16 both are rounding's: on the Zen 4 CPU with SmolLM2-135M (16 × 220, inductor) the
  eager bf16 gradients are 1.8% from fp32 ones by norm, the compiled 1.6%, and the two 2.0% from each other (up to
  11% at a tensor's largest entry).

    .venv/bin/python scripts/compiled_training_ab.py [--model smollm2-135m] [--device cpu|cuda] [--batch 32
        --length 220 --window 16] [--seconds 1.5] [--repeats 3] [--backend inductor] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from fedspear.experiments.bench import _sync, _timed, flop_counts, matmul_flops, train_flops
from fedspear.interaction import Trace
from fedspear.runtime.compiled_training import use_compiled_training
from fedspear.runtime.model import LoraSettings, add_lora, load_base, model_device
from fedspear.training import completion_logprobs, dropout_modules, pack


def traces(rows: int, length: int, window: int, seed: int = 0) -> list[Trace]:
    """``rows`` random traces of ``length`` tokens, the last ``window`` of them the completion."""
    rng = random.Random(seed)
    out = []
    for i in range(rows):
        ids = [rng.randrange(100, 1000) for _ in range(length)]
        out.append(Trace(f"u{i}", ids[: length - window], ids[length - window :], False))
    return out


def micro_step(model, batch, dtype_used: str) -> torch.Tensor:
    """Forward and backward of one micro-step (the gradients stay on the parameters); returns the loss (0-d)."""
    logp = completion_logprobs(model, batch, dtype_used)  # [B, C]
    loss = -(logp * batch.completion_mask).sum() / batch.completion_mask.sum()
    loss.backward()
    return loss.detach()


def gradients(model, batch, dtype_used: str) -> tuple[float, dict[str, torch.Tensor]]:
    """One micro-step with dropout off: its loss and every LoRA gradient (float32 copies)."""
    model.train()
    for module in dropout_modules(model):
        module.eval()
    model.zero_grad(set_to_none=True)
    loss = micro_step(model, batch, dtype_used).item()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    model.train()
    return loss, grads


def graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def relative_differences(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """How far ``grads`` are from ``reference`` (same names): ‖Δ‖ / ‖reference‖ over all tensors together
    (``norm``), and the largest element difference relative to its tensor's largest reference entry (``max``)."""
    num = sum(float(((grads[n] - reference[n]) ** 2).sum()) for n in reference) ** 0.5
    den = sum(float((reference[n] ** 2).sum()) for n in reference) ** 0.5
    worst = max(float((grads[n] - reference[n]).abs().max()) / max(float(reference[n].abs().max()), 1e-30)
                for n in reference)
    return {"norm": num / max(den, 1e-30), "max": worst}


def main() -> None:
    """Parse the arguments, measure (module docstring), print, and write ``--json`` after each phase (a run stopped
    by a time limit keeps what it measured)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=220)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backend", default=None, help="torch.compile backend (default: fedspear's, inductor)")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args()
    second = (args.batch - args.batch // 4, args.length - args.length // 8, args.window + args.window // 2)
    if min(args.batch, second[0]) < 2 or args.window < 2 or second[2] >= second[1]:
        p.error(f"--batch {args.batch} --length {args.length} --window {args.window}: the second shape {second} "
                "needs at least 2 rows, a window of 2 or more and a window shorter than its rows")
    torch.manual_seed(0)
    base, _, dtype_used = load_base(args.model, "auto", args.device)
    model = add_lora(base, LoraSettings(), seed=0)
    for name, param in model.named_parameters():  # a trained-looking adapter: its A gets a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.01)
    device = model_device(model)
    first = pack(traces(args.batch, args.length, args.window), 0, device)
    other = pack(traces(*second, seed=1), 0, device)
    n = 8192 if device.type == "cuda" else 1024  # fedspear bench's sizes: a GPU needs large products to fill up
    peak = matmul_flops(torch.bfloat16 if dtype_used == "bf16" else torch.float32, n, 1.0, str(device))
    flops = train_flops(flop_counts(model), args.batch, args.length, args.window) / (args.batch * args.length)
    out = {"model": args.model, "device": str(device), "dtype": dtype_used, "batch": args.batch,
           "length": args.length, "window": args.window, "second_shape": second,
           "backend": args.backend or "inductor", "dropout": LoraSettings().dropout, "matmul_bound_flops": peak}

    def write() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)

    def rate() -> float:
        model.train()

        def step():
            micro_step(model, first, dtype_used)
            model.zero_grad(set_to_none=True)
        per_call, _ = _timed(step, args.seconds, device)
        return args.batch * args.length / per_call

    rate()  # eager warm-up
    before = graphs()
    use_compiled_training(model, "on", backend=args.backend)
    compile_s = {}
    for name, batch in (("first", first), ("second shape", other)):
        model.train()
        _sync(device)
        start = time.perf_counter()
        micro_step(model, batch, dtype_used)
        _sync(device)
        compile_s[name] = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        print(f"first compiled micro-step of the {name}: {compile_s[name]:.1f} s ({graphs() - before} graphs)",
              flush=True)
    out["compile_s"], out["graphs"] = compile_s, graphs() - before
    write()
    arms = {"eager": "off", "compiled": "on"}
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for rep in range(args.repeats):
        for arm, setting in (arms.items() if rep % 2 == 0 else reversed(arms.items())):
            use_compiled_training(model, setting, backend=args.backend)
            times[arm].append(rate())
        print(f"pair {rep + 1}: " + ", ".join(f"{arm} {t[-1]:.0f}" for arm, t in times.items()) + " tokens/s",
              flush=True)
    out["repeats"] = args.repeats
    out["tokens_per_s"] = {arm: statistics.median(t) for arm, t in times.items()}
    out["utilisation"] = {arm: r * flops / peak for arm, r in out["tokens_per_s"].items()}
    write()
    e, c = out["tokens_per_s"]["eager"], out["tokens_per_s"]["compiled"]
    print(f"training {args.batch} × {args.length} (window {args.window}): eager {e:.0f} → compiled {c:.0f} tokens/s "
          f"({c / e:.3f}×); {out['utilisation']['eager']:.0%} → {out['utilisation']['compiled']:.0%} of the "
          f"{dtype_used} matmul bound ({peak / 1e12:.1f} TFLOP/s); {dtype_used} on {device}", flush=True)
    # the gradients with dropout off (the same masks both ways: none), which compiles one more graph
    use_compiled_training(model, "off")
    eager_loss, eager_grads = gradients(model, first, dtype_used)
    use_compiled_training(model, "on", backend=args.backend)
    loss, grads = gradients(model, first, dtype_used)
    out["graphs_after"] = graphs() - before
    out["gradients"] = {"loss_compiled": loss, "loss_eager": eager_loss,
                        **{f"{k}_relative_difference": v for k, v in relative_differences(grads, eager_grads).items()}}
    write()
    g = out["gradients"]
    print(f"dropout off: loss {loss:.6f} compiled, {eager_loss:.6f} eager; LoRA gradients apart by "
          f"{g['norm_relative_difference']:.2e} (norm of the difference ÷ norm), at most "
          f"{g['max_relative_difference']:.2e} of a tensor's largest entry; {out['graphs_after']} graphs in all")


if __name__ == "__main__":
    main()
