"""One decode step's token drawn from temperature, top-k and top-p (nucleus) filtered logits, from the top-k entries
alone (``NucleusSampler``: the sampler of every sampled answer — rollouts, revisions, the chat page).

What it replaces: transformers' ``generate`` with ``do_sample`` draws a step's token through
``TemperatureLogitsWarper`` → ``TopKLogitsWarper`` → ``TopPLogitsWarper`` → softmax → ``torch.multinomial`` over the
whole vocabulary (transformers ``generation/logits_process.py``; ``generation/utils.py``, ``_sample``). Two of those
pass over every vocabulary entry although top-k has left ``top_k`` finite ones: the top-p warper sorts the whole row
(``torch.sort``), and ``multinomial`` draws one exponential variate per entry (ATen's one-sample path takes the
argmax of p / Exp(1)). On this project's 2-core CPUs the chain adds about half a step to each of the model's own
steps: at batch 32 ≈ 57 ms per step with SmolLM2's 49,152-token vocabulary (its greedy step: ≈ 110–140 ms) and
≈ 180 ms with Qwen2.5's 151,936; this sampler takes 3.0 and 8.6 ms (Zen 4 with AVX-512 BF16, 2026-11-28,
``scripts/sampling_cost.py``, logits rounded to bf16).

What it computes: the same distribution, from ``torch.topk`` of the scaled logits —

- temperature: ``scores / temperature`` (as ``TemperatureLogitsWarper``);
- top-k: every token at least as large as the k-th largest (as ``TopKLogitsWarper``: with ties at the k-th value
  more than k are kept). The top 2k are taken, and twice as many again while a row's last one still ties the k-th:
  bf16 logits tie often (random logits rounded to bf16: ≈ 70% of rows at the 50th, in runs of 1–8 tokens), so the
  room is needed, and a second ``topk`` nearly never;
- top-p: over the kept tokens in ascending order, drop those whose cumulative probability is ≤ 1 − top_p, never the
  largest (as ``TopPLogitsWarper`` with ``min_tokens_to_keep = 1``, whose softmax and cumulative sum over a sorted
  row see the same finite entries in the same order: the other entries are −inf, probability 0);
- the draw: ``torch.multinomial`` over the kept tokens' softmax.

Sync-free (``NucleusSampler(sync_free=True)``; ``generate`` asks for it where a compiled decode reads its stop check
one step late, on a GPU: ``runtime.compiled``, "Stop checks"): a step reads nothing back to the host, so that the
host can queue the next step while the GPU still runs this one. Two of the steps above read a device value on the
host, which on a GPU waits for it — the widening test (a row's last token tying the k-th) and ``torch.multinomial``'s
checks of its probabilities (``.item()`` on their min, max and row sums; ``multinomial_out`` in ATen's
``native/Distributions.cpp``). Sync-free, the whole row is taken, sorted (``topk`` of the vocabulary: nothing to
widen; transformers' top-p warper sorts the whole row at every step too; what the sort costs on a GPU is not
measured), and the draw is the one-sample path of ``torch.multinomial`` itself without its checks: the argmax of
p / q with q ~ Exp(1) drawn by the same generator (``draw``: on the CPU the same indices as ``torch.multinomial``
for the same seed, ``tests/test_sampling.py``). The same number of tokens is kept with the same probabilities; which
of equal tokens at the top-p boundary is kept may differ from the top-2k way (``torch.topk``'s order of ties over
another width), as between transformers and either. For a given seed the draws differ from the top-2k way's (the
variates are drawn over the whole row).

So each token has the probability transformers' chain gives it, up to fp32 rounding in the softmax's sum, except
where tokens of equal logit straddle the top-p boundary: which of them is dropped is each implementation's choice
(transformers': its ``torch.sort``'s order of ties; here: ``torch.topk``'s), the same number with the same
probability. bf16 logits tie often, so on them about half the rows keep a different one of such equal tokens.
``tests/test_sampling.py`` checks the kept sets and probabilities against transformers' warpers and the draws'
frequencies against those probabilities. The random stream is not transformers': for a given seed the sampled
answers differ from those of a fedspear before 2026-11-28 (the same distribution, other draws).

How ``generate`` uses it: as its one logits processor with ``do_sample = False``. The processor returns −inf
everywhere but the drawn token, whose score is 0, and greedy decoding takes that token; ``output_logits`` still gives
the raw logits.

Decision (2026-11-28): ``top_k = 50``. SPEC §2 names temperature 0.8 and top-p 0.95 only; every sampled answer of
this project so far also went through transformers' default ``top_k = 50`` (``GenerationConfig``; the packaged
models' generation configs set no sampling keys), so the sampler keeps it: the policy that answers stays the one
every committed result sampled from. A model loaded from a folder or the hub whose generation config sets its own
``top_k`` keeps it, and one that sets another warper (``min_p``, ``typical_p``, …) samples through transformers'
chain as before (``sampler_for``).
"""

from __future__ import annotations

import torch

TOP_K = 50  # transformers' GenerationConfig default, in effect in every sampled answer (decision above)


class NucleusSampler:
    """A transformers ``LogitsProcessor`` that draws each row's next token from the temperature-scaled, top-k and
    top-p filtered distribution of ``scores`` (module docstring; give it to ``generate`` with ``do_sample=False``).

    Args:
        temperature: divides the logits (> 0).
        top_p: nucleus mass kept, in (0, 1]; 1 keeps every top-k token.
        top_k: most tokens kept (≥ 1; ties at the k-th value are all kept); None: no top-k (the whole row is sorted,
            as transformers' top-p does).
        sync_free: read nothing back to the host (module docstring: the whole row sorted, ``draw``); None: where
            the scores are on a CUDA device. ``generate`` sets it for its batches.
    Raises:
        ValueError: a setting out of its range.
    """

    def __init__(self, temperature: float, top_p: float, top_k: int | None = TOP_K, sync_free: bool | None = None):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 (got {temperature!r})")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {top_p!r})")
        if not (top_k is None or (isinstance(top_k, int) and top_k >= 1)):
            raise ValueError(f"top_k must be an integer ≥ 1 or None (got {top_k!r})")
        self.temperature, self.top_p, self.top_k = float(temperature), float(top_p), top_k
        self.sync_free = sync_free
        self.invalid: torch.Tensor | None = None  # sync-free steps: whether any drew from probabilities with a NaN

    def kept(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens the filters keep, per row.

        Args:
            scores: raw next-token logits, ``[B, V]``.
        Returns:
            ``(logits, ids)``, both ``[B, K]`` (K ≥ min(top_k, V)) and sorted by logit, largest first: the scaled
            logits of the kept tokens, −inf where a row keeps fewer than K, and their vocabulary ids (−inf entries
            carry the ids of dropped tokens).
        """
        scores = scores / self.temperature
        vocab = scores.shape[-1]
        k = vocab if self.top_k is None else min(self.top_k, vocab)
        # room for ties: torch.topk of 100 costs what topk of 51 does; sync-free: the whole row, nothing to widen
        width = vocab if self._sync_free(scores) else min(2 * k, vocab)
        logits, ids = scores.topk(width, dim=-1)  # [B, width], largest first
        kth = logits[:, k - 1 : k]  # [B, 1]
        while width < vocab and bool((logits[:, -1:] == kth).any()):  # a row's last token ties the k-th: widen
            width = min(vocab, 2 * width)
            logits, ids = scores.topk(width, dim=-1)
        logits = logits.masked_fill(logits < kth, float("-inf"))  # every token tied with the k-th is kept
        if self.top_p < 1.0:
            cumulative = logits.flip(-1).softmax(-1).cumsum(-1)  # [B, K], smallest first
            drop = cumulative <= 1 - self.top_p
            drop[:, -1] = False  # the largest is always kept
            logits = logits.masked_fill(drop.flip(-1), float("-inf"))
        return logits, ids

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """One decode step: ``scores`` ``[B, V]`` → ``[B, V]``, 0 at each row's drawn token and −inf elsewhere (the
        greedy choice is the draw)."""
        logits, ids = self.kept(scores)
        probs = logits.softmax(-1)  # [B, K]
        if self._sync_free(scores):
            nan = probs.isnan().any()  # on the device: read once per generate call (check), not per step
            self.invalid = nan if self.invalid is None else self.invalid | nan
            drawn = ids.gather(-1, draw(probs))  # [B, 1]
        else:
            drawn = ids.gather(-1, torch.multinomial(probs, 1))  # raises on NaN probabilities itself
        return torch.full_like(scores, float("-inf")).scatter_(-1, drawn, 0.0)

    def check(self) -> None:
        """After a ``generate`` call: raise where a sync-free step drew from probabilities with a NaN (NaN or
        infinite logits: a broken model or adapter), as ``torch.multinomial`` raises at once on the CPU's way; then
        forget it. Reads one device value on the host.

        Raises:
            RuntimeError: a step's probabilities had a NaN.
        """
        invalid, self.invalid = self.invalid, None
        if invalid is not None and bool(invalid):
            raise RuntimeError("the model's next-token probabilities contain NaN (NaN or infinite logits: a broken "
                               "model or adapter); the sampled tokens are meaningless")

    def _sync_free(self, scores: torch.Tensor) -> bool:
        return scores.is_cuda if self.sync_free is None else self.sync_free


def draw(probs: torch.Tensor) -> torch.Tensor:
    """One index per row of ``probs`` ``[B, K]`` (rows of probabilities), drawn as ``torch.multinomial(probs, 1)``
    draws it — the argmax of p / q, q ~ Exp(1) from the default generator (ATen ``native/Distributions.cpp``,
    ``multinomial_out``'s one-sample path: the same variates, so the same index) — without multinomial's checks of
    ``probs``, which read device values on the host. Where those checks would raise (a NaN, an infinite or a
    negative probability, a row of zeros: a broken model's logits), the index is meaningless instead
    (``NucleusSampler.check`` tells afterwards).

    Returns:
        ``[B, 1]`` int64 indices into the last dimension.
    """
    return probs.div(torch.empty_like(probs).exponential_(1)).argmax(-1, keepdim=True)


# sampling settings of a model's generation config that transformers applies as further warpers; the sampler has none
OTHER_WARPERS = {"top_h": None, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}


def sampler_for(model, temperature: float, top_p: float) -> NucleusSampler | None:
    """The sampler that draws what transformers' ``generate(do_sample=True, temperature=..., top_p=...)`` would for
    ``model``: its generation config's ``top_k`` where it sets one (0: none), else ``TOP_K`` (transformers' default).
    None where that config also asks for a warper the sampler does not implement (``OTHER_WARPERS``, e.g. a hub
    model's ``min_p``): the caller then samples through transformers' own chain. The packaged models' configs set
    none of these.

    Raises:
        ValueError: ``temperature`` or ``top_p`` out of range (``NucleusSampler``).
    """
    config = getattr(model, "generation_config", None)
    if any(getattr(config, key, unset) not in (None, unset) for key, unset in OTHER_WARPERS.items()):
        return None
    top_k = getattr(config, "top_k", None)
    return NucleusSampler(temperature, top_p, TOP_K if top_k is None else (top_k or None))
