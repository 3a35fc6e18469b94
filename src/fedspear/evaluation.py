"""Central evaluation of the global adapter (SPEC §6).

Primary metric: accuracy of the final answer of a greedy generation (the paper's "accuracy of the final produced
answer"), scored with the task's ``is_correct``. Secondary, for multiple-choice tasks: log-likelihood accuracy —
one forward over the prompt, then argmax over the label tokens at the first answer position (the authors'
ARC/HellaSwag protocol). When generation runs too, the log-likelihood scores come from its first decoding step
(the same prompt forward), so they cost nothing extra.

**Decision:** with a chat template the answer starts the assistant turn, so the label is scored as its bare token
("A"); without one the prompt ends in "Answer:" (``fedspear.interaction.render`` adds no blank line after a closing
colon) and the label is scored as " A", the token that continues "Answer:".

Both come with n and a 95% Wilson score interval.
"""

from __future__ import annotations

import math
import random
import time
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from . import progress
from .health import eval_health
from .runtime.generation import (eval_batch_rows, first_processor_sees_raw_logits, generate, host_columns,
                                 shared_prefix_length)
from .interaction import render
from .runtime.model import autocast, model_device, pad_id
from .tasks.base import Example

if TYPE_CHECKING:
    from .config import RunConfig


def wilson_interval(correct: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval for a binomial proportion ``correct / n`` → ``(low, high)``; (0, 1) when n = 0.

    The interval always holds ``correct / n``: at p = 0 and p = 1 the formula's bound equals p exactly, but in floats
    it can land a hair inside (e.g. 4/4 → high 0.9999999999999999), which made a plot's error bar negative.
    """
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))


ANSWER_CUE = "Answer:"
"""How the ARC-Challenge and HellaSwag prompts end; without a chat template the answer continues it (" A")."""


def label_token_ids(tokenizer, labels: Sequence[str]) -> list[int]:
    """First token id of each label as it would begin the answer (see the module docstring).

    With a chat template: the label's own first token ("A"), which starts the assistant turn. Without one: the
    first token after ``"Answer:"`` in the tokenisation of ``"Answer: A"`` — the id that ``render(prompt)``, which
    ends in ``"Answer:"``, is continued with when the text ``prompt + " A"`` is tokenised. (Usually the id of
    ``" A"`` alone; read off the cue so that a SentencePiece tokenizer, whose ``" A"`` on its own may start with a
    bare ``"▁"``, gives the same id as in running text.)
    """
    if getattr(tokenizer, "chat_template", None):
        return [tokenizer.encode(label, add_special_tokens=False)[0] for label in labels]
    cue = tokenizer.encode(ANSWER_CUE, add_special_tokens=False)
    out = []
    for label in labels:
        full = tokenizer.encode(f"{ANSWER_CUE} {label}", add_special_tokens=False)
        shared = next((i for i, (a, b) in enumerate(zip(cue, full)) if a != b), min(len(cue), len(full)))
        out.append(full[shared])
    return out


@torch.no_grad()
def next_token_logits(model, tokenizer, contexts: Sequence[Sequence[int]], *, dtype_used: str = "fp32",
                      batch_size: int = 16, reuse_prefix: bool = True,
                      columns: Sequence[Sequence[int]] | None = None) -> torch.Tensor | list[torch.Tensor]:
    """Next-token logits after each context, one forward per context → ``[N, V]`` float32, in input order; with
    ``columns`` (per context, the token ids to keep: log-likelihood scoring's label tokens) a list of ``N`` float32
    tensors ``[len(columns[i])]`` instead, so the vocabulary's logits are not held for every item (Qwen2.5's 152k
    tokens: 0.6 MB an item).

    The tokens every context shares (chat template, system text, instruction: 53 of ≈124 tokens for ARC with
    Qwen2.5) are run once and their KV cache is reused by every batch (``reuse_prefix``); the rest of each context
    is right-padded after it. Batches are formed in order of context length so they pad little. Works for any
    transformers causal LM, peft-wrapped or not, that has ``get_decoder`` and ``get_output_embeddings``.

    The ``[N, V]`` logits are on the model's device; the ``columns`` form's tensors are on the host (one gather and
    one copy per batch).

    Raises:
        ValueError: ``columns`` names columns for another number of contexts than ``len(contexts)``.
    """
    import copy

    if columns is not None and len(columns) != len(contexts):
        raise ValueError(f"columns names columns for {len(columns)} contexts, not {len(contexts)}")
    device = model_device(model)
    if not contexts:
        return [] if columns is not None else torch.zeros(0, 0, device=device)
    pad = pad_id(tokenizer)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    prefix = shared_prefix_length(contexts) if reuse_prefix else 0
    model.eval()
    cache = None
    if prefix:
        with autocast(dtype_used, device.type):
            cache = decoder(input_ids=torch.tensor([list(contexts[0][:prefix])], device=device),
                            use_cache=True).past_key_values
    order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]))
    out: list[torch.Tensor | None] = [None] * len(contexts)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        tails = [list(contexts[r][prefix:]) for r in rows]
        width = max(len(t) for t in tails)
        # laid out on the host, then one copy each to the model's device (on a GPU each copy waits for it)
        ids = np.full((len(rows), width), pad, dtype=np.int64)  # [B, S], right-padded after P
        mask = np.zeros((len(rows), prefix + width), dtype=np.int64)  # [B, P + S]
        mask[:, :prefix] = 1
        for i, tail in enumerate(tails):
            ids[i, : len(tail)] = tail
            mask[i, prefix : prefix + len(tail)] = 1
        ids, mask = torch.as_tensor(ids, device=device), torch.as_tensor(mask, device=device)
        positions = torch.arange(prefix, prefix + width, device=device).expand(len(rows), -1)  # [B, S]
        past = None
        if cache is not None:
            past = copy.deepcopy(cache)
            past.batch_repeat_interleave(len(rows))
        with autocast(dtype_used, device.type):
            hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=past,
                             use_cache=past is not None).last_hidden_state  # [B, S, H]
            last = hidden[torch.arange(len(rows), device=device),
                          torch.tensor([len(t) - 1 for t in tails], device=device)]  # [B, H]
            logits = head(last).float()  # [B, V]
        if columns is None:
            for i, r in enumerate(rows):
                out[r] = logits[i]  # [V]
        else:
            for r, kept in zip(rows, host_columns(logits, [columns[r] for r in rows])):
                out[r] = kept  # [K]
        progress.advance(len(rows))
    return torch.stack(out) if columns is None else out


def loglik_predictions(model, tokenizer, examples: Sequence[Example], task, *, dtype_used="fp32",
                       batch_size: int = 16, reuse_prefix: bool = True) -> list[str]:
    """The label with the highest next-token log-probability after each prompt (one forward per item, see
    ``next_token_logits``), in the order of ``examples``."""
    contexts = [render(tokenizer, [task.prompt(ex)]) for ex in examples]
    labels = [label_token_ids(tokenizer, ex.labels) for ex in examples]
    scores = next_token_logits(model, tokenizer, contexts, dtype_used=dtype_used, batch_size=batch_size,
                               reuse_prefix=reuse_prefix, columns=labels)  # N × [labels]
    return [ex.labels[int(row.argmax())] for row, ex in zip(scores, examples)]


def generation_rows(model, contexts: Sequence[list[int]], task, batch_size: int | str, max_new_tokens: int,
                    loglik: bool = True) -> int:
    """How many of ``contexts`` ``evaluate`` answers at a time (``eval_batch_rows`` for its longest context and the
    token budget): where it also scores log-likelihood on a multiple-choice task and the model's generation config
    adds a logits processor (``first_processor_sees_raw_logits`` False), ``generate`` keeps every step's logits,
    ``max_new_tokens`` × vocabulary × 4 bytes a row, which ``"auto"`` counts beside the KV cache."""
    keeps_steps = loglik and task.MULTIPLE_CHOICE and not first_processor_sees_raw_logits(model)
    extra = max_new_tokens * model.config.vocab_size * 4 if keeps_steps else 0
    return eval_batch_rows(batch_size, model, max(map(len, contexts)) + max_new_tokens, row_bytes=extra)


def generated_items(examples: Sequence[Example], generation_size: int) -> list[Example]:
    """The items ``evaluate`` answers by generation: the first ``generation_size`` of ``examples`` (0 or at least
    ``len(examples)``: all of them)."""
    return list(examples[:generation_size]) if 0 < generation_size < len(examples) else list(examples)


def evaluate(model, tokenizer, examples: Sequence[Example], task, *, dtype_used: str = "fp32",
             generation: bool = True, loglik: bool = True, batch_size: int | str = 32,
             max_new_tokens: int | None = None, generation_size: int = 0,
             answers: list | None = None) -> dict[str, float | str]:
    """Accuracy of ``model`` on ``examples``.

    ``generation_size`` > 0 generates only for the first ``generation_size`` examples (``n_gen``; callers pass a
    fixed order) while log-likelihood still scores all of them (``n``): a whole test split scored at one forward
    per item, with the costlier generation on a subset.

    ``max_new_tokens`` bounds each greedy answer (default: the task's ``MAX_NEW_TOKENS``; runs pass their own
    ``max_new_tokens`` so evaluation answers under the same budget as the clients).

    ``batch_size``: answers generated together, a number or ``"auto"`` (``generation_rows``: 32 on a CPU, on a GPU
    by its memory); the number used is returned as ``batch_size``.

    Returns:
        ``n``, and for each metric computed (``acc_gen``; ``acc_ll`` for multiple choice): the accuracy, its
        Wilson 95% interval (``<name>_low``, ``<name>_high``), plus ``seconds_evaluate`` and, for generation, the
        share of answers that could be parsed (``parsed_gen``), the share cut off by the token budget (no EOS
        within it, ``cutoff_gen``) and the predicted-label distribution
        (``pred_<label>`` counts) so a shift of the label prior is visible, with the learning-health figures of
        ``fedspear.health.eval_health`` (length, reasoning share, gold counts, entropy). ``correct_<name>`` holds
        the outcome per item in evaluation order ("1" right, "0" wrong; a string of length ``n`` or ``n_gen``), so
        evaluations of the same items can be compared item by item (``fedspear.experiments.compare.stats.paired_gain``).

    ``answers``, when a list is given, receives one dict per item in evaluation order: ``uid``, ``gold`` and, for
    each metric computed on that item, the answer and its verdict (``answer_gen``: the label read from the greedy
    answer, None when none could be parsed; ``answer_ll``: the top-scoring label; ``correct_gen`` / ``correct_ll``)
    and, for generated items, ``text`` (special tokens dropped), ``tokens`` (EOS included), ``cutoff`` (no EOS
    within the budget) and ``reasons`` (the task's rule) — what ``fedspear.answers`` keeps per evaluated round.
    """
    t0 = time.perf_counter()
    out: dict[str, float | str] = {"n": len(examples)}
    predictions = None
    generated = generated_items(examples, generation_size)
    if generation and examples:
        if len(generated) < len(examples):
            out["n_gen"] = len(generated)
        examples_all, examples = examples, generated
        contexts = [render(tokenizer, [task.prompt(ex)]) for ex in examples]
        # the first step's logits serve log-likelihood scoring: asked for only when scored (where the model's
        # generation config adds a logits processor, generate then keeps every step's [B, V] logits until the batch
        # ends: ≈ 5 GB for 32 answers of 256 tokens with a 152k vocabulary; runtime.generation), and of those only
        # the label tokens' are kept (a [V] row per item would hold 0.6 MB each with Qwen2.5)
        first: list[torch.Tensor] | None = [] if loglik and task.MULTIPLE_CHOICE else None
        columns = [label_token_ids(tokenizer, ex.labels) for ex in examples] if first is not None else None
        budget = max_new_tokens or task.MAX_NEW_TOKENS
        out["batch_size"] = rows = generation_rows(model, contexts, task, batch_size, budget, loglik)
        with progress.phase("evaluation: generation"):
            completions = generate(model, tokenizer, contexts, max_new_tokens=budget, dtype_used=dtype_used,
                                   do_sample=False, batch_size=rows, first_logits=first, first_columns=columns)
        predictions = [ex.labels[int(logits.argmax())] for logits, ex in zip(first or [], examples)]
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        labels_gen = [task.extract_answer(t, ex) for t, ex in zip(texts, examples)]
        outcomes = "".join("1" if a == ex.gold else "0" for a, ex in zip(labels_gen, examples))
        correct = outcomes.count("1")
        out["correct_gen"] = outcomes
        out["acc_gen"] = correct / len(examples)
        out["acc_gen_low"], out["acc_gen_high"] = wilson_interval(correct, len(examples))
        out["parsed_gen"] = sum(a is not None for a in labels_gen) / len(examples)
        eos = tokenizer.eos_token_id
        cutoff = [not c or c[-1] != eos for c in completions]
        out["cutoff_gen"] = sum(cutoff) / len(examples)
        labels = sorted({l for ex in examples for l in ex.labels})
        for label in labels:
            out[f"pred_{label}"] = sum(a == label for a in labels_gen)
        rule = getattr(task, "reasons", None)
        reasoned = [bool(rule(t)) if rule is not None else False for t in texts]
        out.update(eval_health(labels, labels_gen, [ex.gold for ex in examples], [len(c) for c in completions],
                               reasoned))
        examples = examples_all
    if loglik and task.MULTIPLE_CHOICE and examples:
        predictions = predictions or []  # from the generation pass, for the items it covered
        if len(predictions) < len(examples):  # the rest: one forward per item
            with progress.phase("evaluation: log-likelihood", total=len(examples) - len(predictions), unit="items"):
                predictions += loglik_predictions(model, tokenizer, examples[len(predictions):], task,
                                                  dtype_used=dtype_used)
        outcomes = "".join("1" if p == ex.gold else "0" for p, ex in zip(predictions, examples))
        correct = outcomes.count("1")
        out["correct_ll"] = outcomes
        out["acc_ll"] = correct / len(examples)
        out["acc_ll_low"], out["acc_ll_high"] = wilson_interval(correct, len(examples))
    if answers is not None:
        for i, ex in enumerate(examples):
            item: dict[str, object] = {"uid": ex.uid, "gold": ex.gold}
            if "correct_gen" in out and i < len(labels_gen):
                item["answer_gen"], item["correct_gen"] = labels_gen[i], out["correct_gen"][i] == "1"
                item.update(text=texts[i], tokens=len(completions[i]), cutoff=cutoff[i], reasons=reasoned[i])
            if "correct_ll" in out:
                item["answer_ll"], item["correct_ll"] = predictions[i], out["correct_ll"][i] == "1"
            answers.append(item)
    out["seconds_evaluate"] = time.perf_counter() - t0
    return out


def eval_items(examples: Sequence[Example], eval_size: int, eval_gen_size: int) -> list[Example]:
    """The fixed held-out subset a run evaluates, in evaluation order (SPEC §6).

    ``eval_size`` items drawn with a fixed seed (1234), the same for every run seed and algorithm, so runs compare
    on identical items (0 = all); then the ``eval_gen_size`` items also answered by generation first, chosen with
    another fixed seed (4321), the rest after them in file order.
    """
    items = list(examples)
    if eval_size and eval_size < len(items):
        items = random.Random(1234).sample(items, eval_size)
    if eval_gen_size and eval_gen_size < len(items):
        chosen = set(random.Random(4321).sample(range(len(items)), eval_gen_size))
        items = [items[i] for i in sorted(chosen)] + [x for i, x in enumerate(items) if i not in chosen]
    return items


class Evaluator:
    """Base model + LoRA adapter and the fixed held-out subset it scores (SPEC §6): the server's evaluation in a run
    and ``fedspear eval``'s, one code path.

    Args:
        cfg: the run's settings (model, dtype, task, data, LoRA shape, ``eval_*`` keys, ``max_new_tokens``).
        split: the split to score (default: the task's ``EVAL_SPLIT``).
        limit: keep only the split's first ``limit`` records in file order (``fedspear eval --limit``, lm-eval's
            meaning) before ``eval_items`` chooses the subset; None keeps all.
    Raises:
        ModelError / DataError: the model or the split cannot be loaded, or the split holds no usable record (message
            names which).
    """

    def __init__(self, cfg: "RunConfig", split: str | None = None, limit: int | None = None):
        from .runtime.compiled import use_compiled_decode
        from .runtime.model import LoraSettings, add_lora, load_base
        from .tasks import empty_split_error, get_task, load_split

        self.cfg = cfg
        self.task = get_task(cfg.task)
        self.split = split or self.task.EVAL_SPLIT
        items, self.skipped = load_split(cfg, self.split)  # before the model: bad data fails in a second
        if not items:
            raise empty_split_error(cfg, self.split)
        self.examples = eval_items(items[:limit] if limit else items, cfg.eval_size, cfg.eval_gen_size)
        base, self.tokenizer, self.dtype_used = load_base(cfg.model, cfg.dtype, cfg.device)
        self.model = add_lora(base, LoraSettings(cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.last_layers),
                              seed=cfg.seed)
        use_compiled_decode(self.model, cfg.compile_decode)

    def initial_adapter(self) -> dict[str, np.ndarray]:
        """The fresh adapter (every ``lora_B`` zero: the base model), name → array."""
        from .runtime.model import get_adapter

        return get_adapter(self.model)

    def peft_config(self) -> dict:
        return self.model.peft_config["default"].to_dict()

    def batch_rows(self) -> int | None:
        """The batch its greedy answers decode at (``generation_rows`` over the items it generates for), None where
        it generates none (``eval_generation`` off)."""
        if not self.cfg.eval_generation or not self.examples:
            return None
        items = generated_items(self.examples, self.cfg.eval_gen_size)
        contexts = [render(self.tokenizer, [self.task.prompt(ex)]) for ex in items]
        return generation_rows(self.model, contexts, self.task, self.cfg.eval_batch_size,
                               self.cfg.max_new_tokens or self.task.MAX_NEW_TOKENS)

    def __call__(self, arrays: dict[str, np.ndarray], answers: list | None = None) -> dict[str, float | str]:
        """``evaluate`` with ``arrays`` loaded as the adapter (``set_adapter`` raises ValueError on a name or
        shape that does not fit the model)."""
        from .runtime.model import set_adapter

        set_adapter(self.model, arrays)
        return evaluate(self.model, self.tokenizer, self.examples, self.task, dtype_used=self.dtype_used,
                        generation=self.cfg.eval_generation, max_new_tokens=self.cfg.max_new_tokens,
                        generation_size=self.cfg.eval_gen_size, batch_size=self.cfg.eval_batch_size,
                        answers=answers)
