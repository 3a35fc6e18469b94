"""Central differential privacy for fedspear rounds: Flower's fixed-clipping wrappers, its clipping mod and its RDP
accountant, wired around ``WinWeightedFedAvg`` (``--set dp=client`` or ``dp=server``).

What happens in a DP round (McMahan et al. 2018, "Learning differentially private recurrent language models",
arXiv:1710.06963, the DP-FedAvg that ``flwr/serverapp/strategy/dp_fixed_clipping.py`` cites):

1. Every sampled client's update Δ_k = θ_k − θ^(t) is scaled to L2 norm ≤ C (``dp_clip_norm``) over the whole
   adapter ("flat clipping"). ``dp = "client"``: on the client, by Flower's ``fixedclipping_mod`` on the ClientApp's
   train handler (``dp_clipping_mod``), wrapped by ``DifferentialPrivacyClientSideFixedClipping``, which sends C in
   the train config; the server never sees an unclipped update. ``dp = "server"``: the server clips every reply
   (``DifferentialPrivacyServerSideFixedClipping``); it sees the raw updates and must be trusted with them.
2. The server averages with a fixed denominator: θ^(t) + (1/m) Σ_k clip(Δ_k), m = ``clients_per_round``
   (``fedspear.server.aggregation.fixed_denominator_mean``).
3. The wrapper adds N(0, σ²) to every value, σ = z·C/m (``dp_noise_multiplier`` z; Flower's ``compute_stdv``).
4. One Gaussian mechanism is composed per noised release in Flower's ``RdpAccountant``; ε at δ (``dp_delta``) is
   written into each round's record (``dp_epsilon`` …) and its state is checkpointed with the round's adapter.

The guarantee is client-level (ε, δ)-DP of the sequence of global adapters, with add-or-remove-one-client
neighbours. It does **not** cover what fedspear writes beside the adapter: each client's counters (wins, losses,
prompts, tokens, loss values) travel in the clear and are logged in ``metrics.jsonl``, as is the norm of each
client's update as aggregated (``update_norm``, ≤ C: it shows whether clipping bit), nor which clients replied or
were rejected. Server-side evaluation only post-processes the released adapters.

**Decision (weights under DP).** Equal weights with a fixed denominator m = ``clients_per_round``: each accepted
client whose reply weight (win count for SPEAR and Feedback SFT) is > 0 adds clip(Δ_k)/m, held to norm C once more
in float64 by ``fixed_denominator_mean`` (whatever rounding or the server's slack let through). One client then moves
the average by at most C/m whatever the others send, which is what σ = z·C/m is calibrated for: the estimator
Flower's own accounting assumes (equal weights, ``FedAvg.aggregate_train``), except that Flower's accounted mode
refuses rounds with fewer than m replies or a zero weight, which fedspear allows (see the next decisions). The paper's
win-weighted mean Σ w_k θ_k / Σ w_k is not used under DP: a client holding most of the wins moves it by up to ~2C,
so with Flower's σ the effective noise multiplier would be up to ~2m times smaller than z, and the win counts that
set the weights are themselves data the mechanism does not protect. A client with no win still contributes nothing
(as in the win-weighted mean); that decision reads its own reply only, so it keeps the bound.

**Decision (zero-win guard under DP).** The paper's guard (all sampled clients have zero wins → keep θ^(t)) is not
applied: whether *any* client won depends on every client jointly, so one client could switch the others' updates
on or off (sensitivity C instead of C/m). Under DP such a round releases θ^(t) + noise like any other.

**Decision (dropped and rejected clients).** The denominator stays m. A client that raised, did not answer in time,
or failed the reply checks (``fedspear.server.validation.check_reply``, including ``max_update_norm``) counts as a zero
update: the round's update shrinks towards θ^(t) but the sensitivity stays C/m. Dividing by the number of accepted
replies would need σ = z·C/|accepted|, which Flower's wrappers do not do. Such replies are removed *before* the
wrapper sees them (``WinWeightedFedAvg.screen``): Flower's wrappers return (None, None) for a round with any error
reply, without calling the inner strategy, and its server-side clipping would crash on a reply of the wrong size.
A round with no accepted reply releases nothing (no noise, no composition) and follows fedspear's empty-round rules.

**Decision (server optimisers).** FedAdam / FedYogi run *after* the noise, on the noised average (``server_step``),
so their moments and every later θ are post-processing of noised releases. Inside ``aggregate_train`` (as without
DP) they would be noised after a nonlinear step whose moments carry un-noised averages into later rounds: no
guarantee. Robust rules (median, trimmed mean) are refused: σ = z·C/m is not calibrated for them (``config.py``).

**Workaround (zero updates).** Flower 1.41–1.42's flat clipping divides C by the update's norm
(``clip_inputs_inplace``, ``flwr/supercore/differential_privacy.py:56``; open upstream fix flwrlabs/flower#7631), so
an update that is exactly zero — a client with nothing to train on returns θ^(t) unchanged — raises
ZeroDivisionError: in the client mod (the client becomes an error reply) and in the server-side wrapper (the
ServerApp crashes). A zero update is within any bound and adds nothing to the fixed-denominator sum, so fedspear
lets it bypass the clipping: ``dp_clipping_mod`` returns such a reply unclipped, and ``PrivateRounds`` hands such
replies to the inner strategy directly (``WinWeightedFedAvg.extra_replies``) instead of through the server-side
wrapper's clipping loop. The round is released (noised and composed) exactly as if Flower had clipped them. With
fewer replies than m the server-side wrapper then logs Flower's warning that the number of replies differs from
``num_sampled_clients`` (``dp_fixed_clipping.py``); the fixed denominator keeps the bound, so it is harmless here.

**Decision (client-side clipping, checked by the server).** Under ``dp = "client"`` the server rejects a reply whose
update norm exceeds C·(1 + ``NORM_SLACK``): a node running a ClientApp without the mod would otherwise void the
guarantee silently. The slack covers float32 arithmetic: the mod measures the norm in float32 (pairwise sums,
relative error about 1e-6 for millions of values) and sends θ^(t) + clip(Δ) rounded to float32, which moves the
update's norm by at most 2⁻²⁴·‖θ^(t)‖₂ ≈ 6e-8·‖θ^(t)‖₂, below 1e-3·C whenever C ≥ 6e-5·‖θ^(t)‖₂ (pick C
above that, or honest clients are rejected). With ``update_encoding`` fp16 / int8 the client encodes the clipped
update last (``fedspear.fl.records``, its mod outside this one) and the bound grows by the encoding's error bound:
C·(1 + ``NORM_SLACK``)·(1 + ``ENCODING_ERROR``), i.e. ×1.032 for int8.

**Decision (accounting).** ``SamplingMethod.NO_AMPLIFICATION`` with ``ADD_OR_REMOVE_ONE``: fedspear's client sample
is ``random.Random(seed·1000003 + round)`` over the nodes (``WinWeightedFedAvg.sample``), and the seed is in the
run's ``config.toml``; amplification by subsampling assumes a sample the adversary cannot see, so none is claimed
(that also spares the Poisson-sampling assumption fedspear's fixed-size sample does not meet). ε therefore grows
with the number of noised rounds T only, as for the Gaussian mechanism composed T times. ``dp_delta`` defaults to
1e-5 and must be below 1/``num_clients``. With z = 0 (clipping only) no mechanism is composed and ε is reported
as ∞ (``null`` in ``metrics.jsonl``).

**Decision (noise randomness).** Flower draws the noise from NumPy's global legacy RNG (``np.random.normal``,
``flwr/supercore/differential_privacy.py``), which anything in the ServerApp process may have seeded from the
public run seed (``transformers.set_seed`` does). So each round's noise is drawn inside ``noise_rng``: the global
RNG is reseeded from 256 bits of OS entropy (``secrets``) and restored afterwards, so the rest of the process keeps
its reproducible draws. ``dp_noise_seed`` (tests only) seeds it with (seed, round) instead, which makes noise
reproducible across a kill and resume and voids the guarantee for anyone who reads the config. MT19937 and
floating-point Gaussians are not a cryptographically secure sampler; that caveat of floating-point DP
implementations applies here as it does to Flower's.

Only this module and the rest of ``fedspear.fl`` import ``flwr``. The accountant needs ``dp-accounting``
(``flwr[dp]``); it is imported when a DP run starts.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import numpy as np
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp.mod import fixedclipping_mod
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
)
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM, compute_stdv

from fedspear.config import ConfigError, RunConfig
from fedspear.fl.strategy import WinWeightedFedAvg
from fedspear.fl.records import ENCODING_ERROR, from_record

log = logging.getLogger("fedspear")

NORM_SLACK = 1e-3  # relative slack on C for client-clipped replies (float32 rounding; see the module docstring)
STATE_FILE = "privacy_accountant.json"  # beside each round's adapter (``RunDir.save_adapter``)


def reply_norm_bound(cfg: RunConfig) -> float | None:
    """The update-norm bound the server enforces on every reply: ``max_update_norm``, and under ``dp = "client"``
    also C·(1 + ``NORM_SLACK``) (the smaller wins). Under ``dp = "server"`` the server clips, so only
    ``max_update_norm`` (on the raw update, before clipping). With a compressed ``update_encoding`` the decoded update
    may exceed the clipped one's norm by the encoding's relative error, so C's bound grows by that factor
    (``fedspear.fl.records.ENCODING_ERROR``); ``fixed_denominator_mean`` holds each update to C again."""
    slack = (1 + NORM_SLACK) * (1 + ENCODING_ERROR[cfg.update_encoding])
    bounds = [b for b in (cfg.max_update_norm, cfg.dp_clip_norm * slack if cfg.dp == "client" else None)
              if b is not None]
    return min(bounds) if bounds else None


def dp_clipping_mod(msg: Message, context: Context, call_next) -> Message:
    """Flower's ``fixedclipping_mod`` when the wrapper asked for client-side clipping, else a pass-through.

    Attached to the ClientApp's train handler only (``@app.train(mods=[dp_clipping_mod])``): a ClientApp-wide mod
    would also wrap the ``query`` handler, whose message holds no ArrayRecord, and turn it into an error reply.
    ``DifferentialPrivacyClientSideFixedClipping`` puts ``clipping_norm`` into the train config; its presence is
    what switches clipping on (the mod then clips reply − sent to that norm and refuses malformed records).
    """
    config = msg.content.config_records.get("config")
    if config is None or KEY_CLIPPING_NORM not in config:
        return call_next(msg, context)
    reply = call_next(msg, context)
    if not reply.has_error() and _is_zero_update(msg, reply):
        return reply  # nothing to clip, and Flower's clipping would divide by zero (module docstring)
    return fixedclipping_mod(msg, context, lambda _msg, _context: reply)


def _is_zero_update(msg: Message, reply: Message) -> bool:
    """Whether the reply's single ArrayRecord equals the sent one value for value (Δ = 0 exactly)."""
    if len(msg.content.array_records) != 1 or len(reply.content.array_records) != 1:
        return False
    return _same_values(next(iter(msg.content.array_records.values())),
                        next(iter(reply.content.array_records.values())))


def _same_values(sent: ArrayRecord, back: ArrayRecord) -> bool:
    """Whether two ArrayRecords hold the same names and, value for value, the same arrays."""
    return list(sent.keys()) == list(back.keys()) and all(
        np.array_equal(sent[k].numpy(), back[k].numpy()) for k in sent.keys())


@contextmanager
def noise_rng(seed: int | None, server_round: int) -> Iterator[None]:
    """NumPy's global RNG seeded for one round's DP noise, restored on exit (see **Decision (noise randomness)**).

    Args:
        seed: ``dp_noise_seed``; None (every real run) → 256 bits from ``secrets``.
        server_round: mixed into a test seed so that rounds draw different noise.
    """
    saved = np.random.get_state()
    if seed is None:
        np.random.seed(np.frombuffer(secrets.token_bytes(32), dtype=np.uint32))
    else:
        np.random.seed([seed, server_round])
    try:
        yield
    finally:
        np.random.set_state(saved)


class PrivacyLedger:
    """ε spent so far: Flower's ``RdpAccountant`` with one ``GaussianPrivacyEvent(z, m, N)`` per noised release.

    Raises (constructor):
        ConfigError: ``dp-accounting`` is not installed (``pip install "flwr[dp]"``).
    """

    def __init__(self, cfg: RunConfig):
        self.noise_multiplier, self.clip_norm, self.delta = cfg.dp_noise_multiplier, cfg.dp_clip_norm, cfg.dp_delta
        self.sample_size, self.population = cfg.clients_per_round, cfg.num_clients
        self.sigma = compute_stdv(self.noise_multiplier, self.clip_norm, self.sample_size)
        self.releases = 0
        self.accountant = None
        if self.noise_multiplier > 0:
            from flwr.serverapp import NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod

            try:
                self.accountant = RdpAccountant(PrivacyConfig(
                    target_delta=self.delta, population_size=self.population,
                    neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                    sampling_method=SamplingMethod.NO_AMPLIFICATION))
            except ImportError as err:
                raise ConfigError(f"dp = {cfg.dp!r} needs the privacy accountant: {err}") from None

    def release(self) -> None:
        """Compose one noised release (one round's adapter)."""
        from flwr.serverapp import GaussianPrivacyEvent

        if self.accountant is not None:
            self.accountant.compose(GaussianPrivacyEvent(noise_multiplier=self.noise_multiplier,
                                                         sample_size=self.sample_size,
                                                         population_size=self.population))
        self.releases += 1

    @property
    def epsilon(self) -> float:
        """ε at ``delta`` after the releases so far: 0 before any, ∞ with z = 0."""
        if self.releases == 0:
            return 0.0
        if self.accountant is None:
            return math.inf
        return self.accountant.get_privacy_spent(self.delta).epsilon

    def record(self) -> dict:
        """The ``dp_*`` keys of a round record (``dp_epsilon`` is None, i.e. ∞, when z = 0)."""
        eps = self.epsilon
        return {"dp_epsilon": eps if math.isfinite(eps) else None, "dp_delta": self.delta,
                "dp_noise_multiplier": self.noise_multiplier, "dp_clip_norm": self.clip_norm,
                "dp_sigma": self.sigma, "dp_releases": self.releases}

    def state_dict(self) -> dict:
        """JSON-serialisable state (Flower's accountant state plus the release count)."""
        return {"releases": self.releases,
                "accountant": self.accountant.state_dict() if self.accountant is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``; Flower's accountant refuses state made under another privacy configuration.

        Raises:
            ValueError: the state does not belong to these settings.
        """
        if (state.get("accountant") is None) != (self.accountant is None):
            raise ValueError("privacy accountant state was saved with another noise multiplier")
        if self.accountant is not None:
            self.accountant.load_state_dict(state["accountant"])
            if self.accountant.num_releases != state["releases"]:
                raise ValueError("privacy accountant state: release counts disagree")
        self.releases = int(state["releases"])


class PrivateRounds:
    """The DP side of ``run_server``: Flower's wrapper around ``strategy``, the ledger, the noise RNG.

    Args:
        strategy: built with ``dp_denominator = clients_per_round``, ``dp_clip_norm = dp_clip_norm`` and
            ``max_update_norm = reply_norm_bound(cfg)``.

    Raises:
        ValueError: the strategy's denominator or clipping norm differ from ``cfg``'s.
    """

    def __init__(self, strategy: WinWeightedFedAvg, cfg: RunConfig):
        if strategy.dp_denominator != cfg.clients_per_round or strategy.dp_clip_norm != cfg.dp_clip_norm:
            raise ValueError("a DP round needs the strategy's fixed denominator = clients_per_round and its "
                             "clipping norm = dp_clip_norm")
        wrapper = (DifferentialPrivacyClientSideFixedClipping if cfg.dp == "client"
                   else DifferentialPrivacyServerSideFixedClipping)
        # no accountant= : Flower's built-in accounting refuses a strategy that overrides aggregate_train
        self.wrapper = wrapper(strategy, noise_multiplier=cfg.dp_noise_multiplier, clipping_norm=cfg.dp_clip_norm,
                               num_sampled_clients=cfg.clients_per_round)
        self.strategy = strategy
        self.ledger = PrivacyLedger(cfg)
        self.noise_seed = cfg.dp_noise_seed
        if cfg.dp_noise_seed is not None:
            log.warning("dp_noise_seed = %d: the DP noise is reproducible from the config (tests only); "
                        "this run has no privacy guarantee", cfg.dp_noise_seed)
        if cfg.dp_noise_multiplier == 0:
            log.warning("dp_noise_multiplier = 0: updates are clipped but no noise is added; ε is infinite")

    def configure_train(self, server_round: int, arrays: ArrayRecord, config, grid) -> Iterable[Message]:
        return self.wrapper.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: list[Message]
                        ) -> tuple[dict[str, np.ndarray] | None, dict[int, str], set[int]]:
        """Screen the replies, let the wrapper clip (server side), average and add noise, compose the release,
        then take the server-optimiser step on the noised average.

        Returns:
            ``(arrays, rejected, dropped)``: the new global adapter (None when no reply was accepted), and the
            excluded nodes with their reasons and which of them dropped out (as ``WinWeightedFedAvg`` keeps them).
        """
        strategy = self.strategy
        accepted = strategy.screen(server_round, replies)
        rejected, dropped = dict(strategy.rejected), set(strategy.dropped)
        if not accepted:
            strategy.last_aggregated = False
            return None, rejected, dropped
        reference = strategy.reference()
        if isinstance(self.wrapper, DifferentialPrivacyServerSideFixedClipping):  # zero updates skip the clipping
            zero = [m for m in accepted
                    if _same_values(strategy.current_arrays, next(iter(m.content.array_records.values())))]
            accepted = [m for m in accepted if not any(m is z for z in zero)]
            strategy.extra_replies = zero
        try:
            with noise_rng(self.noise_seed, server_round):
                noised, _ = self.wrapper.aggregate_train(server_round, accepted)
        finally:
            strategy.extra_replies = []
        rejected.update(strategy.rejected)  # the inner re-check after server-side clipping (normally nothing)
        if noised is None:
            return None, rejected, dropped
        self.ledger.release()
        return strategy.server_step(reference, from_record(noised, strategy.current_layout)), rejected, dropped
