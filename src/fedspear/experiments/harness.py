"""EleutherAI's lm-evaluation-harness on fedspear's offline data: ``fedspear eval --harness lm-eval`` (no ``flwr``).

The field compares models with lm-eval, so this runs lm-eval's *own* ``arc_challenge`` and ``hellaswag`` task
configs (prompt, answer choices, ``acc`` and ``acc_norm``, HellaSwag's ``process_docs``), read from the installed
``lm_eval/tasks/*/…yaml``, with one change: the documents come from the JSONL files fedspear ships (or ``data_dir``)
through ``datasets``' ``json`` loader instead of the Hugging Face hub, so it runs offline. The model is lm-eval's
``hf`` model on the same local weights fedspear loads (``fedspear.runtime.model_zoo.resolve_model_dir``) with the
adapter as ``peft=``, on the run's device, in fp32 or bf16 (``fedspear eval``'s ``--dtype``: ``auto`` is bf16 where
the CPU has bf16 units, the precision fedspear's own protocol then uses too, so the two protocols differ in prompt and
scoring only).

The two protocols differ by design, and their accuracies are not the same number:

- **fedspear** (``fedspear.evaluation``): the task prompt lists the lettered options; log-likelihood accuracy is the
  argmax over the option *letters* at the first answer position (one forward per item), generation accuracy reads
  the letter of a greedy answer.
- **lm-eval** (``multiple_choice``): no options in the prompt (ARC: ``Question: …\\nAnswer:``; HellaSwag: the
  context), each option's *text* scored as a continuation; ``acc`` = argmax of the summed log-probability,
  ``acc_norm`` = argmax after dividing by the continuation's length in bytes.

Optional extra: ``pip install 'fedspear[harness]'`` (lm-eval 0.4).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# fedspear task → (lm-eval task whose YAML is reused, the split it scores, fedspear's file for that split)
TASKS = {
    "arc_challenge": ("arc/arc_challenge.yaml", "test", "test"),
    "hellaswag": ("hellaswag/hellaswag.yaml", "validation", "validation"),
}

HF_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # fedspear's names → lm-eval's hf ``dtype=``


class HarnessError(ValueError):
    """lm-eval is missing or cannot score this task (message says which and what to do)."""


def harness_split(task: str) -> str:
    """The split lm-eval's config for ``task`` scores.

    Raises:
        HarnessError: ``task`` has no lm-eval counterpart here.
    """
    if task not in TASKS:
        raise HarnessError(f"--harness lm-eval scores {', '.join(TASKS)}; {task} has no lm-eval task here")
    return TASKS[task][1]


def task_config(task: str, data_dir: str | None = None) -> dict[str, Any]:
    """lm-eval's own config for ``task`` (the ``!function`` hooks resolved), reading fedspear's JSONL offline.

    Raises:
        HarnessError: lm-eval is not installed, or ``task`` has no lm-eval counterpart here.
    """
    try:
        import lm_eval
        from lm_eval.tasks._yaml_loader import load_yaml
    except ImportError:
        raise HarnessError("--harness lm-eval needs lm-evaluation-harness: pip install 'fedspear[harness]'") from None
    harness_split(task)
    from ..tasks.common import PACKAGE_DATA_DIR

    yaml_file, split, ours = TASKS[task]
    config = load_yaml(Path(lm_eval.__file__).parent / "tasks" / yaml_file)
    config.pop("tag", None)
    source = Path(data_dir or PACKAGE_DATA_DIR) / task / f"{ours}.jsonl"
    if not source.is_file():
        raise HarnessError(f"{source}: data file not found")
    config.update(task=f"fedspear_{task}", dataset_path="json", dataset_name=None,
                  dataset_kwargs={"data_files": {split: str(source)}}, training_split=None,
                  validation_split=split if split == "validation" else None,
                  test_split=split if split == "test" else None, fewshot_split=None)
    return config


def evaluate_lm_eval(model_dir: str | Path, task: str, adapter: str | Path | None = None, *,
                     data_dir: str | None = None, limit: int | None = None, batch_size: int | str = 16,
                     dtype: str = "fp32", device: str = "cpu") -> dict[str, Any]:
    """Score the model (with ``adapter`` when given) on ``task`` with lm-eval, offline.

    ``dtype``: ``fp32`` or ``bf16`` (the weights lm-eval's ``hf`` model loads, ``dtype=float32 | bfloat16``);
    ``device``: ``cpu`` or ``cuda`` (lm-eval's ``device=``);
    ``limit``: score only the first ``limit`` documents of the split (lm-eval's ``--limit``);
    ``batch_size``: documents scored together, or ``"auto"``: lm-eval finds the largest that fits (its
    ``--batch_size``).

    Returns:
        ``n``, ``acc``, ``acc_norm`` (fractions), their standard errors (``acc_stderr``, ``acc_norm_stderr``, from
        lm-eval), ``seconds_evaluate`` and ``items``: per document in file order ``{"doc_id", "acc", "acc_norm",
        "logliks"}`` (1.0 right, 0.0 wrong; the summed log-probability of each choice's continuation, nats).
    Raises:
        HarnessError: see ``task_config``.
        ValueError: ``dtype`` is neither fp32 nor bf16.
    """
    import time

    if dtype not in HF_DTYPES:
        raise ValueError(f"dtype must be fp32 or bf16 for lm-eval (got {dtype!r})")

    config = task_config(task, data_dir)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate

    args: dict[str, Any] = {"pretrained": str(model_dir), "dtype": HF_DTYPES[dtype], "device": device}
    if adapter is not None:
        args["peft"] = str(adapter)
    t0 = time.perf_counter()
    out = simple_evaluate(model="hf", model_args=args, tasks=[config], batch_size=batch_size, limit=limit,
                          log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                          fewshot_random_seed=0)
    name = config["task"]
    result = out["results"][name]
    samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
    return {"n": len(samples), "acc": result["acc,none"], "acc_norm": result["acc_norm,none"],
            "acc_stderr": result.get("acc_stderr,none"), "acc_norm_stderr": result.get("acc_norm_stderr,none"),
            "seconds_evaluate": time.perf_counter() - t0,
            "items": [{"doc_id": s["doc_id"], "acc": float(s["acc"]), "acc_norm": float(s["acc_norm"]),
                       "logliks": [float(r[0]) for r in s["filtered_resps"]]} for s in samples]}
