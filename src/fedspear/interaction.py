"""Phase 1 of SPEAR — interaction (paper Alg. 1, lines 3–25; SPEC §2).

For each prompt x of the client's batch: sample y0 from the original context c0; if the feedback source says it is
right, (c0, y0) joins the win set. Otherwise, up to N times, ask for partial feedback f_n on the previous attempt,
build the revision context c_n = c0 ‖ y_prev ‖ f_n and sample y_n. The first correct revision puts (c0, y_n) — the
*original* context — in the win set and (c0, y0, α = 1) in the lose set; if no revision succeeds, (c0, y0, α = 0.5)
joins the lose set.

Generation is batched: every pending prompt of an attempt goes through one ``generate`` call (left padding, KV cache
on, sampling at temperature 0.8 / top-p 0.95, stop at EOS or the task's ``MAX_NEW_TOKENS``). A revision context
starts with c0, whose keys and values the initial call computed: that call keeps them for the prompts it got wrong
(``generate``'s ``keep``), and each revision call copies them instead of running c0 again (``cached``; the model is
the same throughout the interaction). On ARC-Challenge with SmolLM2-135M a revision row ran ≈ 215 tokens of which
≈ 110 were c0's own (the rest of c0 is shared by every row and ran once per batch already).

**Rendering c_n (SPEC §2 Decision):** with a chat template, c_n is the conversation user(c0), assistant(y_prev),
user(f_n); without one, the plain texts joined by blank lines. Where the answer starts (:func:`render`): with a
template, at the assistant turn; without one, after a blank line — except after a text that ends in a colon (ARC's
and HellaSwag's "Answer:"), which the answer continues on the same line (" A"), as log-likelihood scoring
(``fedspear.evaluation.label_token_ids``) and the authors' " A".." D" protocol assume.

**Decision (guard, ``revised_wins``; issue 41).** On a binary task the feedback names the wrong label ("'no' is not
the right answer"), so a revision can be right by flipping the label with no reasoning; SPEAR learns a right
revision from the *original* context c0, so such wins teach the model to answer bare (measured: StrategyQA answers
that shrank to "Answer: no"). ``revised_wins = "all"`` (default) is the paper's rule: every right revision is a
win. With ``"reasoned"`` a right revision that does not reason before its final answer (the task's ``reasons``
rule, e.g. ≥ 10 words before "Answer: …") is **dropped**: it joins neither set, and y0 still joins the lose set
with α = 1, as for any successful revision (a right answer was reachable, so y0 is confidently wrong). It is not
put in the lose set: the gated tail unlikelihood (Eq. 6, τ = 24 on StrategyQA) would push down the last tokens of a
*right* answer — its "Answer: yes" — from c0, teaching the wrong label, not "reason first". It is not revised
again either: the oracle's feedback may only follow a wrong answer (``check_not_correct``). Initial answers are not
guarded: y0 is sampled from c0 itself, so a right bare y0 is the model's own on-policy answer, not a label flipped
by feedback. Counted per client-round: ``revised_wins_bare`` (right revisions that do not reason, under either
rule) and ``revisions_guarded`` (those dropped); ``revisions_successful`` still counts every right revision, so
wins = initial_correct + revisions_successful − revisions_guarded.

Learning health (``HEALTH`` counters, issue 41): token counts and reasoning of the initial answers and of every
revision attempt, summed per client-round, with each client's median lengths (``fedspear.health`` reads them).
With a ``log`` list, ``interact`` also records every prompt's attempts (text, parsed answer, verdict, tokens, EOS,
reasoning, the feedback that preceded it) and its outcome: the client's training traces (``fedspear.answers``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from . import progress
from .counters import INTERACTION
from .feedback import FeedbackSource
from .runtime.generation import generate
from .tasks.base import Example


@dataclass
class Trace:
    """A (context, completion) pair the training phase consumes.

    Attributes:
        uid: the example's id (pairs a win and a lose trace of the same prompt for the margin M_τ).
        prompt_ids: token ids of c0 (chat template applied, generation prompt included).
        completion_ids: sampled token ids, EOS included when the model produced it.
        has_eos: whether ``completion_ids`` ends with EOS (the tail set of Eq. 5 excludes it).
        alpha: confidence weight of a lose trace (1.0 or 0.5); 1.0 for wins.
    """

    uid: str
    prompt_ids: list[int]
    completion_ids: list[int]
    has_eos: bool
    alpha: float = 1.0


def make_trace(uid: str, context: list[int], completion: list[int], eos: int, alpha: float = 1.0) -> Trace:
    """A trace of ``completion`` after ``context`` (copies both; ``has_eos`` read off the completion's last id)."""
    return Trace(uid, list(context), list(completion), bool(completion) and completion[-1] == eos, alpha)


def decode(tokenizer, ids: list[int]) -> str:
    """A completion's text as the feedback source reads it (special tokens dropped)."""
    return tokenizer.decode(ids, skip_special_tokens=True)


def sample_counted(model, tokenizer, contexts: Sequence[list[int]], counters: dict, **generation) -> list[list[int]]:
    """:func:`fedspear.runtime.generation.generate` (``generation``: its keyword arguments) with the counters every
    algorithm reports: ``generations`` (+1 per context) and ``tokens_generated``."""
    ids = generate(model, tokenizer, contexts, **generation)
    counters["generations"] += len(ids)
    counters["tokens_generated"] += sum(len(x) for x in ids)
    return ids


@dataclass
class InteractionResult:
    """Win set, lose set and the counters of SPEC §6 for one client-round.

    ``counters`` keys (:func:`new_counters`): prompts, initial_samples (= prompts here), initial_correct,
    revisions_attempted, revisions_successful, generations, tokens_generated (all ints), seconds_generate_initial,
    seconds_generate_revisions (floats, seconds).
    """

    wins: list[Trace] = field(default_factory=list)
    losses: list[Trace] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)


def render(tokenizer, turns: Sequence[str]) -> list[int]:
    """Token ids of a conversation whose turns alternate user, assistant, user, …, ending with a generation prompt.

    With a chat template: the template's messages and its generation prompt (the answer starts the assistant turn).

    Without one (SPEC §2 Decision), the texts joined by blank lines, then where the answer starts:

    - after a last text ending in a colon, nothing: the closing ``Answer:`` is continued on its line, so the answer's
      first token is ``" A"`` and ``render(prompt) + [id(" A")]`` is exactly the tokenisation of ``prompt + " A"``
      (the tokens log-likelihood scoring compares, and the authors' ARC/HellaSwag protocol);
    - otherwise a blank line (a MathMCQA or StrategyQA prompt ends with its options or question, and a revision
      context with the feedback's instruction: the answer starts a new paragraph).

    Why the colon case: a blank line after ``Answer:`` would end the prompt in two newlines (one token, ``ĊĊ``, in
    GPT-2-style vocabularies) while the scorer compares ``" A"`` .. ``" D"``, which in text follow ``"Answer:"``.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers ≥ 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    text = "\n\n".join(turns)
    return tokenizer(text if text.endswith(":") else text + "\n\n", add_special_tokens=True)["input_ids"]


#: learning-health counters of SPEAR's interaction (module docstring); summed over a round's clients except the
#: ``*_median`` ones (``fedspear.health.round_health``)
HEALTH = ("initial_tokens", "initial_reasoned", "revision_tokens", "revisions_reasoned", "revised_wins_bare",
          "revisions_guarded", "initial_tokens_median", "revision_tokens_median")
REVISED_WINS = ("all", "reasoned")


def new_counters(prompts: int) -> dict[str, float]:
    """The counters every algorithm reports (SPEC §6), zeroed; ``initial_samples`` starts at one per prompt
    (GRPO and RLTF-SD overwrite it with their group samples)."""
    return {**dict.fromkeys(INTERACTION, 0), "prompts": prompts, "initial_samples": prompts,
            "seconds_generate_initial": 0.0, "seconds_generate_revisions": 0.0}


def interact(
    model,
    tokenizer,
    examples: Sequence[Example],
    task,
    feedback_source: FeedbackSource,
    *,
    max_revisions: int = 2,
    max_new_tokens: int | None = None,
    temperature: float = 0.8,
    top_p: float = 0.95,
    dtype_used: str = "fp32",
    seed: int = 0,
    replay: Sequence[Sequence[list[int]]] | None = None,
    revised_wins: str = "all",
    log: list | None = None,
) -> InteractionResult:
    """Run SPEAR's interaction phase on ``examples`` (paper Alg. 1, lines 3–25).

    Args:
        task: the task module (its ``prompt`` renders c0; ``MAX_NEW_TOKENS`` is the default budget).
        feedback_source: says whether a completion is right and gives partial feedback (``FeedbackSource``).
        max_revisions: N, revision attempts per wrong answer (paper default 2).
        seed: seeds torch's sampler so a client-round is reproducible.
        replay: attempts sampled earlier, ``replay[i][n]`` = token ids of y_n for example i (a person's chat,
            ``fedspear.human.replay``): they are used instead of sampling, and a prompt whose attempts run out is
            treated as never revised correctly. Counted as ``replayed_attempts``, not as generations.
        revised_wins: "all" (the paper) or "reasoned": a right revision that does not reason (``task.reasons``) is
            dropped, not won (module docstring, Decision on the guard). A task without ``reasons`` (a chat) counts
            every answer as reasoned.
        log: when a list, receives one dict per prompt, in order: ``uid``, ``gold``, ``attempts`` (per attempt:
            ``text``, ``answer`` (the task's parsed label, None when none), ``correct`` (the feedback source's
            verdict), ``tokens``, ``eos``, ``reasons``, and for revisions the ``feedback`` that preceded it),
            ``outcome`` ("win_initial", "win_revised", "guarded" or "lose") and ``alpha`` of y0's lose trace.
    Returns:
        ``InteractionResult`` with the win set, the lose set (with α) and the counters (``HEALTH`` included).
    Raises:
        ValueError: ``revised_wins`` is not one of ``REVISED_WINS``.
    """
    if revised_wins not in REVISED_WINS:
        raise ValueError(f"revised_wins = {revised_wins!r}: choose one of {', '.join(REVISED_WINS)}")
    max_new_tokens = max_new_tokens or task.MAX_NEW_TOKENS
    eos = tokenizer.eos_token_id
    torch.manual_seed(seed)
    result = InteractionResult()
    counters = new_counters(len(examples))
    prompts = [task.prompt(ex) for ex in examples]
    c0 = [render(tokenizer, [p]) for p in prompts]

    if replay is not None:
        counters["replayed_attempts"] = 0

    def sample(contexts: list[list[int]], indices: list[int], n: int, **reuse) -> list[list[int]]:
        if replay is not None:
            counters["replayed_attempts"] += len(indices)
            return [list(replay[i][n]) for i in indices]
        return sample_counted(model, tokenizer, contexts, counters, max_new_tokens=max_new_tokens,
                              dtype_used=dtype_used, temperature=temperature, top_p=top_p, **reuse)

    def text(ids: list[int]) -> str:
        return decode(tokenizer, ids)

    def trace(i: int, ids: list[int], alpha: float = 1.0) -> Trace:
        return make_trace(examples[i].uid, c0[i], ids, eos, alpha)

    reasons = getattr(task, "reasons", None)
    extract = getattr(task, "extract_answer", None)
    records = [{"uid": ex.uid, "gold": ex.gold, "attempts": [], "outcome": "lose", "alpha": None}
               for ex in examples]

    def observe(i: int, ids: list[int], correct: bool, feedback: str | None = None) -> bool:
        """Note attempt ``ids`` of prompt i (health counters, the log); returns whether it reasons."""
        said = text(ids)
        reasoned = reasons(said) if reasons is not None else True
        if log is not None:
            attempt = {"text": said, "answer": extract(said, examples[i]) if extract is not None else None,
                       "correct": correct, "tokens": len(ids), "eos": bool(ids) and ids[-1] == eos,
                       "reasons": reasoned}
            if feedback is not None:
                attempt["feedback"] = feedback
            records[i]["attempts"].append(attempt)
        return reasoned

    for key in HEALTH:
        counters[key] = 0

    t = time.perf_counter()
    kept: list = []  # the KV cache of c0 ‖ y0 per prompt, for the revisions (module docstring)
    with progress.phase("initial answers"):
        y0 = sample(c0, list(range(len(examples))), 0, **({"keep": kept} if max_revisions else {}))
    counters["seconds_generate_initial"] = time.perf_counter() - t

    pending: list[int] = []  # indices of prompts still wrong
    for i, ids in enumerate(y0):
        correct = feedback_source.is_correct(examples[i], text(ids))
        counters["initial_tokens"] += len(ids)
        counters["initial_reasoned"] += observe(i, ids, correct)
        if correct:
            result.wins.append(trace(i, ids))
            counters["initial_correct"] += 1
            records[i]["outcome"] = "win_initial"
        else:
            pending.append(i)
    counters["initial_tokens_median"] = statistics.median(len(ids) for ids in y0) if y0 else 0
    cached = {i: kept[i] for i in pending} if kept else {}  # only the prompts that will be revised
    del kept
    revision_lengths: list[int] = []

    previous = {i: y0[i] for i in pending}
    exhausted: list[int] = []  # replay only: wrong prompts whose person stopped revising
    t = time.perf_counter()
    for n in range(1, max_revisions + 1):
        if replay is not None:
            exhausted += [i for i in pending if len(replay[i]) <= n]
            pending = [i for i in pending if len(replay[i]) > n]
        if not pending:
            break
        contexts, feedbacks = [], []
        for i in pending:
            f_n = feedback_source.feedback(examples[i], text(previous[i]))
            feedbacks.append(f_n)
            contexts.append(render(tokenizer, [prompts[i], text(previous[i]), f_n]))
        counters["revisions_attempted"] += len(pending)
        with progress.phase(f"revision {n}"):
            revised = sample(contexts, pending, n, **({"cached": [cached[i] for i in pending]} if cached else {}))
        still = []
        for i, y_n, f_n in zip(pending, revised, feedbacks):
            correct = feedback_source.is_correct(examples[i], text(y_n))
            reasoned = observe(i, y_n, correct, f_n)
            counters["revision_tokens"] += len(y_n)
            counters["revisions_reasoned"] += reasoned
            revision_lengths.append(len(y_n))
            if correct:
                counters["revisions_successful"] += 1
                counters["revised_wins_bare"] += not reasoned
                if revised_wins == "reasoned" and not reasoned:  # the guard: dropped, y0 still lost (docstring)
                    counters["revisions_guarded"] += 1
                    records[i]["outcome"] = "guarded"
                else:
                    result.wins.append(trace(i, y_n))  # learn y_n from the *original* context c0
                    records[i]["outcome"] = "win_revised"
                result.losses.append(trace(i, y0[i], alpha=1.0))
                records[i]["alpha"] = 1.0
            else:
                previous[i] = y_n
                still.append(i)
        pending = still
        cached = {i: cached[i] for i in pending} if cached else {}
    counters["seconds_generate_revisions"] = time.perf_counter() - t
    counters["revision_tokens_median"] = statistics.median(revision_lengths) if revision_lengths else 0
    for i in sorted(pending + exhausted):
        result.losses.append(trace(i, y0[i], alpha=0.5))
        records[i]["alpha"] = 0.5
    result.counters = counters
    if log is not None:
        log.extend(records)
    return result
