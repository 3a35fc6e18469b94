"""Batched sampling and greedy decoding from token contexts: one ``generate`` for rollouts, revisions, evaluation and
the chat page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .. import progress
from .compiled import batch_bucket, cache_bucket, compiled_decode, defers_stop_check
from .cpu_kernels import decoding, preallocated_cache
from .model import autocast, merged_adapter, model_device, pad_id
from .sampling import OTHER_WARPERS, sampler_for


def host_columns(logits: torch.Tensor, columns: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Row i's logits at ``columns[i]``, on the host: one gather and one copy for all rows (on a GPU each copy waits
    for it).

    Args:
        logits: ``[B, V]`` (at least ``len(columns)`` rows; rows past them are ignored), any device and dtype.
        columns: per row, the token ids to keep (any number, none included).

    Returns:
        ``len(columns)`` float32 CPU tensors ``[len(columns[i])]``.
    """
    counts = [len(c) for c in columns]
    rows = torch.tensor([i for i, n in enumerate(counts) for _ in range(n)], dtype=torch.long, device=logits.device)
    flat = torch.tensor([c for cols in columns for c in cols], dtype=torch.long, device=logits.device)
    return list(logits[rows, flat].float().cpu().split(counts))


def shared_prefix_length(contexts: Sequence[Sequence[int]]) -> int:
    """Number of leading tokens all ``contexts`` share, capped so every context keeps at least one token after it."""
    if not contexts:
        return 0
    first, limit = contexts[0], min(len(c) for c in contexts) - 1
    n = 0
    while n < limit and all(c[n] == first[n] for c in contexts):
        n += 1
    return n


CPU_EVAL_BATCH = 32  # rows; eval_batch_size = "auto" on a CPU (its default before "auto", the committed results')
GPU_EVAL_BATCH_MAX = 256  # rows; eval_batch_size = "auto" on a GPU decodes at most this many answers together
GPU_CACHE_SHARE = 1 / 16  # of a GPU's memory: what one evaluation batch's KV cache may take under "auto"


def kv_cache_bytes(config, positions: int, value_bytes: int = 2) -> int:
    """Bytes of one row's KV cache over ``positions`` positions: keys and values (2) · layers · key/value heads ·
    head dimension · ``value_bytes`` (2 in bf16). Qwen2.5-1.5B (28 layers, 2 key/value heads of 128): 28,672 B a
    position in bf16, 22.0 MB for a row of 768."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * value_bytes * positions


def eval_batch_rows(setting: int | str, model, positions: int, row_bytes: int = 0) -> int:
    """How many answers ``eval_batch_size = setting`` decodes together on ``model``'s device, for answers of up to
    ``positions`` positions (prompt + new tokens): a number as it is; ``"auto"``: ``CPU_EVAL_BATCH`` on a CPU and,
    on a CUDA GPU, the largest power of two up to ``GPU_EVAL_BATCH_MAX`` whose KV cache over the compiled decode's
    cache length (``kv_cache_bytes`` at ``runtime.compiled.cache_bucket(positions)``, in the model's precision), with
    ``row_bytes`` more a row for what else it holds while it decodes, takes at most ``GPU_CACHE_SHARE`` of the card's
    memory, at least 1.

    On a GPU a decode step of a small batch waits on the host, not on the GPU (Qwen2.5-1.5B's shape on an H200,
    compiled: 13.8 ms a step at batch 32, where its weights stream in 0.8 ms; ``docs/performance.md``), so fewer,
    larger batches answer an evaluation in fewer steps: 500 StrategyQA items in 2 batches of 256 instead of 16 of 32.
    The cap keeps a step inside that regime (at 256 rows its weights, cache reads and matmuls come to a few ms on
    an H100: an estimate from the bounds, not measured). The card's total memory decides, not what is free at the
    time, so one machine evaluates every round of a run at one batch size; a compiled decode keeps each batch's
    cache for the process's life (``runtime.compiled``), and 1/16 leaves the rest to the model, the prefill's
    activations and the clients that share the card. Qwen2.5-1.5B on an H100 (81,559 MiB; 1/16 is 5.3 GB): 364 rows
    of 512 positions (14.7 MB each) → 256, 242 of 768 → 128.

    Raises:
        ValueError: ``setting`` is neither a positive number nor ``"auto"``.
    """
    if setting != "auto":
        if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
            raise ValueError(f"eval_batch_size must be a positive integer or \"auto\" (got {setting!r})")
        return setting
    device = model_device(model)
    if device.type != "cuda":
        return CPU_EVAL_BATCH
    value_bytes = model.get_input_embeddings().weight.element_size()
    per_row = kv_cache_bytes(model.config, cache_bucket(positions), value_bytes) + row_bytes
    fits = int(GPU_CACHE_SHARE * torch.cuda.get_device_properties(device).total_memory // per_row)
    return 1 << (max(1, min(GPU_EVAL_BATCH_MAX, fits)).bit_length() - 1)


MERGE_UP_TO = 1_000_000_000  # parameters; larger models are not merged for generation by default


def merges_adapter(model, dtype_used: str) -> bool:
    """Whether generation merges the LoRA adapter into the weights by default (``generate``'s ``merge``): in fp32,
    where merging changes results by rounding only, and for models up to ``MERGE_UP_TO`` parameters. The merged copy
    of the weights lives while generating (SmolLM2-135M: +0.4 GB; Qwen2.5-1.5B would need +5.7 GB), and only small
    models gain: their decode step is per-operation dispatch, which the LoRA branches multiply, while a 1.5B model's
    is the pass over its weights."""
    return dtype_used == "fp32" and sum(p.numel() for p in model.parameters()) <= MERGE_UP_TO


MIN_REUSED = 16  # tokens: a batch reuses earlier rows' KV (``generate``'s ``cached``) only when one saves this many


@dataclass
class CachedRow:
    """The KV cache of one sequence a ``generate`` call ran (``generate``'s ``keep``): its tokens — the context,
    then the answer tokens whose keys and values the call computed (all but the last one sampled) — and, per layer,
    their keys and values ``[KV heads, len(tokens), head dim]`` in the cache's dtype, at the positions 0 … len − 1.

    Valid for a later call only while the model's weights are the ones they were computed with (the same adapter,
    merged or not as then): within one client-round's interaction, not across rounds."""

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def reusable_length(context: Sequence[int], row: CachedRow | None) -> int:
    """How many leading tokens of ``context`` ``row`` holds the KV of: their common prefix, at most
    ``len(context) − 1`` (a call must still run one token of each context to get its next-token logits)."""
    if row is None:
        return 0
    limit, tokens = min(len(context) - 1, len(row.tokens)), row.tokens
    n = 0
    while n < limit and context[n] == tokens[n]:
        n += 1
    return n


def _filled_cache(model, rows: Sequence[CachedRow | None], lengths: Sequence[int], capacity: int):
    """A fresh cache holding, for row i, ``rows[i]``'s first ``lengths[i]`` positions at columns 0 … lengths[i] − 1
    and zeros up to ``max(lengths)`` (columns the attention mask hides), ``capacity`` positions in all; None where
    the model's cache is not one of plain per-layer keys and values (``cpu_kernels.preallocated_cache``)."""
    cache = preallocated_cache(model, capacity)
    if cache is None:
        return None
    width = max(lengths)
    template = next(r for r in rows if r is not None)
    for layer in range(len(template.keys)):
        filled = []
        for held in (template.keys[layer], template.values[layer]):
            heads, _, dim = held.shape
            filled.append(torch.zeros(len(rows), heads, width, dim, dtype=held.dtype, device=held.device))
        for i, (row, n) in enumerate(zip(rows, lengths)):
            if n:
                filled[0][i, :, :n] = row.keys[layer][:, :n]
                filled[1][i, :, :n] = row.values[layer][:, :n]
        cache.update(filled[0], filled[1], layer)
    return cache


def _kept_rows(cache, chunk: Sequence[list[int]], columns: Sequence[np.ndarray], answers: Sequence[list[int]],
               computed: int) -> list[CachedRow]:
    """``CachedRow`` s of a finished call: row i's context at ``columns[i]`` of ``cache`` (its real tokens, in order),
    then its answer's first ``min(len(answer), computed)`` tokens in the columns after the prompt's (``computed``:
    the steps that ran a forward, one fewer than the call's new tokens)."""
    start = cache.layers[0].keys.shape[-2] - computed  # the first generated token's column
    kept = [min(len(answer), computed) for answer in answers]
    picks = [np.concatenate([columns[i], np.arange(start, start + n)]) for i, n in enumerate(kept)]
    # every row's columns in one copy to the model's device (on a GPU each copy from the host waits for it)
    flat = torch.as_tensor(np.concatenate(picks), device=cache.layers[0].keys.device)
    rows = []
    for i, index in enumerate(flat.split([len(p) for p in picks])):
        keys = [layer.keys[i].index_select(1, index) for layer in cache.layers]  # L × [KV, T, D]
        values = [layer.values[i].index_select(1, index) for layer in cache.layers]
        rows.append(CachedRow(tuple(chunk[i]) + tuple(answers[i][: kept[i]]), keys, values))
    return rows


class _DecodeSteps:
    """A stopping criterion that never stops: it reports each decode step to ``fedspear.progress``."""

    def __init__(self):
        self.count = 0

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.count += 1
        progress.advance()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _PaddingRows:
    """A stopping criterion that stops the rows from ``real`` on at once: the rows a compiled decode adds to fill its
    batch bucket (``runtime.compiled``), so they never keep a batch decoding after its real rows are done."""

    def __init__(self, real: int):
        self.real = real

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        done[self.real :] = True
        return done


# generation-config settings under which transformers adds no logits processor of its own to a ``generate`` call that
# does not sample: token ids, bookkeeping, lengths, and the sampling warpers' settings (applied only when it samples;
# ``runtime.sampling.OTHER_WARPERS`` names those the sampler lacks).
# Anything else — a repetition penalty, bad words, forced or suppressed tokens, a minimum length, and whatever a later
# transformers adds — may put a processor before the caller's (``GenerationMixin._get_logits_processor``).
PLAIN_CONFIG = frozenset({
    "bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "_from_model_config",
    "transformers_version", "use_cache", "output_attentions", "output_hidden_states", "output_scores",
    "output_logits", "return_dict_in_generate", "max_length", "max_new_tokens", "do_sample", "temperature", "top_k",
    "top_p", *OTHER_WARPERS,
})
# settings that add a processor only away from these values (a config may spell them out: ``repetition_penalty: 1.0``)
NEUTRAL_CONFIG = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "guidance_scale": 1.0,
                  "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "min_length": 0, "min_new_tokens": 0}


def first_processor_sees_raw_logits(model) -> bool:
    """Whether the first logits processor passed to ``generate(do_sample=False, …)`` receives the raw logits
    (``outputs.logits[:, -1]`` in float32, what ``output_logits`` returns): transformers runs the processors its
    generation config asks for first and the caller's after them (``_merge_criteria_processor_list``), so only
    where that config sets nothing beyond ``PLAIN_CONFIG`` (the packaged models' configs: token ids alone), or
    sets a ``NEUTRAL_CONFIG`` setting to its neutral value or to None."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return True
    return all(key in PLAIN_CONFIG or (key in NEUTRAL_CONFIG and value in (None, NEUTRAL_CONFIG[key]))
               for key, value in config.to_diff_dict().items())


class _FirstLogits:
    """A logits processor that keeps a copy of the scores of a ``generate`` call's first step and passes every
    step's on unchanged. Placed first where ``first_processor_sees_raw_logits``, it gives the first answer
    position's raw logits ``[B, V]`` (float32) as ``output_logits`` would, without ``generate`` keeping every later
    step's ``[B, V]`` logits until the call ends (Qwen2.5's 152k vocabulary at batch 32: 19.4 MB a step, 5 GB for
    256 tokens)."""

    def __init__(self):
        self.logits: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.logits is None:
            self.logits = scores.clone()  # [B, V]
        return scores


@torch.no_grad()
def generate(
    model,
    tokenizer,
    contexts: Sequence[list[int]],
    *,
    max_new_tokens: int,
    dtype_used: str = "fp32",
    do_sample: bool = True,
    temperature: float = 0.8,
    top_p: float = 0.95,
    batch_size: int = 64,
    first_logits: list[torch.Tensor] | None = None,
    first_columns: Sequence[Sequence[int]] | None = None,
    reuse_prefix: bool = True,
    merge: bool | None = None,
    keep: list[CachedRow] | None = None,
    cached: Sequence[CachedRow | None] | None = None,
) -> list[list[int]]:
    """Sample one completion per context, batched with left padding and the KV cache.

    Args:
        contexts: token ids per prompt (lengths may differ).
        max_new_tokens: generation budget per completion (tokens).
        do_sample: draw each token from the logits scaled by ``temperature``, filtered to the top 50 (or the
            model's generation config's ``top_k``) and then to the ``top_p`` nucleus
            (``runtime.sampling.sampler_for``: transformers' warpers' distribution, from the top-k entries alone);
            ``False``: greedy.
        batch_size: most contexts per ``generate`` call (bounds memory; all pending prompts fit by default).
        first_logits: if a list is given, the raw next-token logits at the first answer position are appended to
            it, one float32 ``[V]`` tensor per context (log-likelihood scoring reuses the generation's prefill).
            Copied from the first step (``_FirstLogits``) where the model's generation config adds no logits
            processor (``first_processor_sees_raw_logits``), else read from ``output_logits``, for which
            ``generate`` keeps every step's ``[B, V]`` logits until the batch ends.
        first_columns: with ``first_logits``, per context the token ids whose first-step logits to keep
            (log-likelihood scoring's label tokens): ``first_logits`` then receives a float32 ``[len(columns[i])]``
            CPU tensor per context instead of the ``[V]`` row on the model's device (Qwen2.5's 152k-token vocabulary:
            0.6 MB a context, which a whole evaluation split would otherwise hold in GPU memory). ``ValueError`` if
            its length differs from ``contexts``'.
        reuse_prefix: run the tokens all contexts of a batch share (chat template, system text, task instruction:
            61 of ≈137 tokens for ARC with SmolLM2) once and hand their KV cache to every row. The rows are laid
            out ``[prefix | left padding | own tokens]``; positions follow the attention mask, so each row sees what
            it would see alone.
        merge: generate with the LoRA adapter merged into the base weights (``model.merged_adapter``: one
            matmul per projection instead of the LoRA branch's 5–6 small ops; the base weights are put back exactly
            after). ``None``: ``merges_adapter`` decides — fp32 models up to 1B parameters, where merging changes
            the result by fp32 rounding only; under bf16 the base weights are bf16 and merging would round the
            update to bf16.
        keep: if a list is given, it receives one ``CachedRow`` per context, in order: the KV cache the call
            computed for the context and its answer, for a later call's ``cached`` (None where nothing was kept: a
            compiled decode). Held until the caller drops it (SmolLM2-135M in bf16 on a CPU: ≈ 35 KB a token).
        cached: per context, a ``CachedRow`` of an earlier call on the same weights, or None: the leading tokens a
            context shares with its row (``reusable_length``) are not run again, their keys and values are copied
            from the row. A SPEAR revision context starts with the prompt c0 its initial answer was sampled from
            (``fedspear.interaction``): ARC-Challenge revisions with SmolLM2 ran ≈ 215 tokens a row, of which ≈ 110
            were c0's own. A batch saving fewer than ``MIN_REUSED`` tokens runs as usual (with ``reuse_prefix``).
            The rows are laid out ``[reused tokens | zeros (hidden) | left padding | own tokens]``; positions
            follow the attention mask, so each row sees what it would see alone, up to rounding: keys and values
            computed in another batch may differ in the last bits (bf16) and a sampled token then with them.
            ``ValueError`` if its length differs from ``contexts``'.

    A model with a compiled decode (``runtime.compiled.use_compiled_decode``; ``compile_decode``) decodes every
    batch through it: its rows padded to a batch bucket, a static KV cache of a length bucket, no prefix sharing and
    no merging (the compiled step reads the adapter's tensors where they are), and ``keep`` / ``cached`` unused.
    Returns:
        One list of new token ids per context, cut after the first EOS (EOS kept).
    Raises:
        ValueError: ``first_columns`` names columns for another number of contexts than ``len(contexts)``.
        RuntimeError: the compiled decode failed (names the setting that turns it off).
    """
    if first_columns is not None and len(first_columns) != len(contexts):
        raise ValueError(f"first_columns names columns for {len(first_columns)} contexts, not {len(contexts)}")
    if cached is not None and len(cached) != len(contexts):
        raise ValueError(f"cached holds rows for {len(cached)} contexts, not {len(contexts)}")
    was_training = model.training
    model.eval()
    # every batch's whole token budget up front, so the phase's ETA covers all of them; a batch that stops early
    # (every row at EOS) counts its unused budget as done
    progress.expect(-(-len(contexts) // batch_size) * max_new_tokens, "tokens")
    compiled = compiled_decode(model) is not None
    merge = False if compiled else (merges_adapter(model, dtype_used) if merge is None else merge)
    try:
        with merged_adapter(model, enabled=merge), decoding():
            return _generate_batches(model, tokenizer, contexts, max_new_tokens, dtype_used, do_sample, temperature,
                                     top_p, batch_size, first_logits, first_columns, reuse_prefix, keep, cached)
    finally:
        model.train(was_training)


def _generate_batches(model, tokenizer, contexts, max_new_tokens, dtype_used, do_sample, temperature, top_p,
                      batch_size, first_logits, first_columns, reuse_prefix, keep=None,
                      cached=None) -> list[list[int]]:
    """``generate``'s loop over batches of ``contexts`` (the model in eval mode, merged or not)."""
    from transformers import LogitsProcessorList

    eos = tokenizer.eos_token_id
    pad = pad_id(tokenizer)
    device = model_device(model)
    # greedy, or the sampler's draw taken greedily (runtime.sampling: transformers' distribution from the top-k
    # entries, or, sync-free, from the whole row), or transformers' own chain where the model's generation config asks
    # for a warper the sampler lacks
    sampler = sampler_for(model, temperature, top_p) if do_sample else None
    if sampler is not None:
        sampler.sync_free = False  # set per batch below: only where the stop check is read a step late
        decoding = dict(do_sample=False, temperature=None, top_p=None, top_k=None,
                        logits_processor=LogitsProcessorList([sampler]))
    elif do_sample:
        decoding = dict(do_sample=True, temperature=temperature, top_p=top_p)
    else:
        decoding = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    compiled = compiled_decode(model)
    reuse_prefix = reuse_prefix and compiled is None  # a static cache is filled by one prefill of the whole batch
    # the first step's raw logits: kept by a processor that runs first where one does, else every step's asked for
    copy_first = first_logits is not None and not decoding["do_sample"] and first_processor_sees_raw_logits(model)
    # a compiled decode's static cache: one length for every batch of the call, the longest context's (a cache is
    # kept per length bucket for the process's life, so an evaluation's batches hold one, as eval_batch_rows assumes)
    positions = max(map(len, contexts), default=0) + max_new_tokens
    out: list[list[int]] = []
    for start in range(0, len(contexts), batch_size):
        chunk = contexts[start : start + batch_size]
        real = len(chunk)
        if compiled is not None:  # the bucket's rows: the last context repeated, stopped at once, dropped
            chunk = list(chunk) + [chunk[-1]] * (batch_bucket(real) - real)
        rows = cached[start : start + batch_size] if cached is not None and compiled is None else None
        reused = [reusable_length(c, r) for c, r in zip(chunk, rows)] if rows is not None else []
        cache = None
        if reused and sum(reused) >= MIN_REUSED:  # [reused | zeros | left padding | own tokens], the reused filled
            width = max(len(c) - n for c, n in zip(chunk, reused))
            cache = _filled_cache(model, rows, reused, max(reused) + width + max_new_tokens)
        if cache is not None:
            prefix, tails = max(reused), [list(c[n:]) for c, n in zip(chunk, reused)]
        else:
            reused = []
            prefix = shared_prefix_length(chunk) if reuse_prefix and len(chunk) > 1 else 0
            tails = [list(c[prefix:]) for c in chunk]
        width = max(len(t) for t in tails)
        # laid out on the host (numpy), then one copy each to the model's device (not one per row: on a GPU each
        # copy from the host waits for it)
        ids = np.full((len(chunk), prefix + width), pad, dtype=np.int64)  # [B, P + L]
        mask = np.zeros((len(chunk), prefix + width), dtype=np.int64)  # [B, P + L]
        if reused:
            for i, n in enumerate(reused):
                ids[i, :n] = chunk[i][:n]
                mask[i, :n] = 1
        elif prefix:
            ids[:, :prefix] = chunk[0][:prefix]
            mask[:, :prefix] = 1
        for i, tail in enumerate(tails):
            ids[i, prefix + width - len(tail) :] = tail
            mask[i, prefix + width - len(tail) :] = 1
        input_ids, attention = torch.as_tensor(ids, device=device), torch.as_tensor(mask, device=device)
        kwargs = dict(decoding)  # this batch's: stopping criteria and the cache are added below
        first = _FirstLogits() if copy_first else None
        if first is not None:
            kwargs["logits_processor"] = LogitsProcessorList([first, *kwargs.get("logits_processor", [])])
        steps = _DecodeSteps() if progress.active() else None
        if steps is not None:
            kwargs["stopping_criteria"] = [steps]
        if compiled is not None:
            kwargs["stopping_criteria"] = kwargs.get("stopping_criteria", []) + [_PaddingRows(real)]
            cache = None  # the bucket's static cache, zeroed for each attempt (call below)
        elif cache is None:  # (one filled with the reused rows is kept)
            cache = preallocated_cache(model, prefix + width + max_new_tokens)  # None: transformers' own cache
        # rows can be kept from plain per-layer keys and values only (not from sliding windows or a static cache)
        plain = cache is not None and compiled is None

        def call():
            if first is not None:
                first.logits = None  # a call run again (CompiledDecode.decode) keeps its own first step
            extra = compiled.generate_kwargs(model, len(chunk), positions) if compiled is not None \
                else ({"past_key_values": cache} if cache is not None else {})
            if sampler is not None and compiled is not None:
                # reading nothing back pays only where the stop check does not read every step either
                sampler.sync_free = defers_stop_check(extra["past_key_values"], device)
            return model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos,
                pad_token_id=pad,
                use_cache=True,
                return_dict_in_generate=True,
                output_logits=first_logits is not None and first is None,
                output_scores=False,  # nor every step's scores, attentions or hidden states, whatever the model's
                output_attentions=False,  # generation config says (return_dict_in_generate would keep them)
                output_hidden_states=False,
                **kwargs,
                **extra,
            )

        with autocast(dtype_used, device.type):
            if prefix and not reused:
                cache = model(input_ids=input_ids[:1, :prefix], past_key_values=cache, use_cache=True).past_key_values
                cache.batch_repeat_interleave(len(chunk))
            try:
                generated = call() if compiled is None else compiled.decode(
                    model, len(chunk), positions, dtype_used, call,
                    steps=lambda out: out.sequences.shape[1] - input_ids.shape[1] - 1)  # the first token: prefill's
            except Exception as err:
                if compiled is None:
                    raise
                raise RuntimeError(f"the compiled decode failed ({type(err).__name__}: {err}); "
                                   "compile_decode = \"off\" decodes without compiling") from err
        if sampler is not None:
            sampler.check()  # a sync-free sampler's NaN probabilities, read once per call
        if steps is not None:
            progress.advance(max_new_tokens - steps.count)  # a batch that ended early: its unused budget
        if first_logits is not None:
            logits = first.logits if first is not None else generated.logits[0]  # [B, V]
            if first_columns is None:
                first_logits.extend(logits[:real].float())  # B × [V]
            else:
                first_logits.extend(host_columns(logits, first_columns[start : start + real]))  # B × [K_i]
        for row in generated.sequences[:real, prefix + width :].tolist():  # [B, new]
            if eos in row:
                row = row[: row.index(eos) + 1]
            out.append(row)
        if keep is not None:
            kept = getattr(generated, "past_key_values", None) if plain else None
            computed = generated.sequences.shape[1] - input_ids.shape[1] - 1  # steps that ran a forward
            if kept is not None and kept.get_seq_length() == input_ids.shape[1] + computed:
                keep.extend(_kept_rows(kept, chunk[:real], [np.flatnonzero(m) for m in mask[:real]], out[-real:],
                                       computed))
            else:  # a compiled decode's static cache (zeroed by the next call), or a cache of other layer kinds
                keep.extend([None] * real)
    return out
