"""What a round costs on the wire (``fedspear.fl.records``): the compressed update encodings (round-trip error bounds
by hand, the order after DP clipping, the server decoding before its checks) and the byte counts (by hand, and
against what Flower's own ``push_objects`` sends); (slow) a tiny-model int8 run recording the bytes of every round."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.supercore.inflatable.inflatable_utils import push_objects

from fedspear.config import ConfigError, RunConfig
from fedspear.fl.privacy import PrivateRounds, reply_norm_bound
from fedspear.fl.records import (ENCODING_ERROR, ENCODING_KEY, INT8_KEYS, LAYOUT_KEY, decode_update, encode_update,
                                 encode_update_mod, from_record, layout_of, to_record, wire_breakdown, wire_bytes)
from fedspear.fl.server_app import add_wire_bytes
from fedspear.fl.strategy import WinWeightedFedAvg
from fedspear.server.validation import update_norm
from fedspear.tensorboard import scalars

from helpers import train_reply

pytestmark = pytest.mark.usefixtures("task_identity")

COUNTERS = {"num-losses": 0, "prompts": 4}
FEDSPEAR = str(Path(sys.executable).with_name("fedspear"))


def _flat(values) -> ArrayRecord:
    return to_record({"x": np.asarray(values, dtype=np.float32)})


def _decoded(sent: ArrayRecord, encoded: ArrayRecord) -> np.ndarray:
    return decode_update(sent, encoded)["adapter"].numpy().astype(np.float64)


# ---- int8 ------------------------------------------------------------------------------------------------------------
def test_int8_by_hand_on_two_blocks():
    """70 values = a block of 64 and a padded block of 6. Block 1: max |x| = 1.27, so s = fl32(1.27/127) ≈ 0.01 and
    0.5 → 50, −1.27 → −127, 0.3 → 30, 0.004 → 0, 0.006 → 1; block 2: max 2.54, s ≈ 0.02, 2.54 → 127, −0.013 → −1.
    θ^(t) = 0, so the decoded adapter is q·s itself; every value within s/2 (plus float32 rounding of q·s)."""
    x = np.zeros(70)
    x[:5] = [0.5, -1.27, 0.3, 0.004, 0.006]
    x[64:66] = [2.54, -0.013]
    sent = _flat(np.zeros(70))
    encoded = encode_update(sent, _flat(x), "int8")
    assert tuple(encoded.keys()) == INT8_KEYS
    q, scales = encoded[INT8_KEYS[0]].numpy(), encoded[INT8_KEYS[1]].numpy()
    assert q.dtype == np.int8 and q.shape == (70,) and scales.dtype == np.float32 and scales.shape == (2,)
    assert scales[0] == pytest.approx(0.01, rel=1e-6) and scales[1] == pytest.approx(0.02, rel=1e-6)
    assert scales[0] * 127.0 >= np.float32(1.27) and scales[1] * 127.0 >= np.float32(2.54)  # s ≥ max/127
    assert list(q[:5]) == [50, -127, 30, 0, 1] and list(q[64:66]) == [127, -1] and not q[5:64].any()
    back = _decoded(sent, encoded)
    x32 = x.astype(np.float32).astype(np.float64)
    s = np.repeat(scales.astype(np.float64), 64)[:70]
    assert np.all(np.abs(back - x32) <= s / 2 + 1e-7 * np.abs(x32))  # 1e-7: the float32 result of q·s


def test_int8_bounds_on_random_updates_and_zero_stays_exact():
    """Random updates of many magnitudes: per value |Δ̂ − Δ| ≤ s_b/2, and ‖Δ̂ − Δ‖ ≤ √64/254·‖Δ‖ (module docstring).
    An exact-zero update decodes to θ^(t) bit for bit."""
    rng = np.random.default_rng(0)
    theta = np.zeros(10_000, np.float32)
    delta = (rng.standard_normal(10_000) * np.exp(rng.uniform(-12, 2, 10_000))).astype(np.float32)
    sent = _flat(theta)
    encoded = encode_update(sent, _flat(delta), "int8")
    back = _decoded(sent, encoded)
    err = back - delta.astype(np.float64)
    s = np.repeat(encoded[INT8_KEYS[1]].numpy().astype(np.float64), 64)[:delta.size]
    assert np.all(np.abs(err) <= s / 2 + 1e-7 * np.abs(delta))
    assert np.linalg.norm(err) <= ENCODING_ERROR["int8"] * np.linalg.norm(delta)
    assert ENCODING_ERROR["int8"] == pytest.approx(8 / 254)

    start = rng.standard_normal(10_000).astype(np.float32)
    same = decode_update(_flat(start), encode_update(_flat(start), _flat(start), "int8"))["adapter"].numpy()
    assert same.dtype == np.float32 and np.array_equal(same, start)


# ---- fp16 ------------------------------------------------------------------------------------------------------------
def test_fp16_relative_error_and_range_by_hand():
    """Δ·2^k in half precision: max|Δ| = 3 → k = 12 (3·2^12 = 12288 ∈ [2^13, 2^14)). Per value |Δ̂ − Δ| ≤ 2^-11·|Δ|
    (+ float32 rounding), also for updates of 1e-6 (subnormal in plain fp16: relative error up to 50%) and of 1e6
    (infinite in plain fp16)."""
    x = np.array([3.0, -1.0, 1e-3, 0.1, 0.0], np.float32)
    sent = _flat(np.zeros(5))
    encoded = encode_update(sent, _flat(x), "fp16")
    assert int(encoded["update-exponent"].numpy()[0]) == 12
    assert encoded["update-fp16"].numpy().dtype == np.float16
    rng = np.random.default_rng(1)
    for scale in (1e-6, 1.0, 1e6):
        delta = (rng.standard_normal(2_000) * scale).astype(np.float32)
        back = _decoded(sent := _flat(np.zeros(2_000)), encode_update(sent, _flat(delta), "fp16"))
        rel = np.abs(back - delta) / np.abs(delta)
        assert rel.max() <= 2.0 ** -11 + 2.0 ** -23, scale
        assert np.linalg.norm(back - delta) <= ENCODING_ERROR["fp16"] * np.linalg.norm(delta)
    plain = (np.float32(1e-6) * np.float32(1.3)).astype(np.float16).astype(np.float64)
    assert abs(plain - 1.3e-6) / 1.3e-6 > 1e-3  # what the exponent avoids


def test_bad_encoded_replies_are_refused_with_the_reason():
    sent = _flat(np.zeros(70))
    good = encode_update(sent, _flat(np.ones(70)), "int8")
    short = ArrayRecord({INT8_KEYS[0]: good[INT8_KEYS[0]], INT8_KEYS[1]: Array(np.zeros(1, np.float32))})
    with pytest.raises(ValueError, match=r"int8 update: expected int8\[70\] and float32\[2\] scales"):
        decode_update(sent, short)
    with pytest.raises(ValueError, match="no broadcast adapter"):
        decode_update(None, good)
    with pytest.raises(ValueError, match="must be one of fp32, fp16, int8"):
        encode_update(sent, sent, "int4")
    with pytest.raises(ValueError, match="the trained adapter has 3 values, the broadcast 70"):
        encode_update(sent, _flat(np.zeros(3)), "int8")
    with pytest.raises(ConfigError, match="update_encoding"):
        RunConfig(update_encoding="int4")


# ---- the server: decode before checks and aggregation ----------------------------------------------------------------
THETA = {"a.lora_A": np.linspace(-1, 1, 96, dtype=np.float32).reshape(8, 12),
         "a.lora_B": np.zeros((12, 8), np.float32)}


class FakeGrid:
    def __init__(self, n: int):
        self.nodes = list(range(100, 100 + n))

    def get_node_ids(self):
        return list(self.nodes)


def _encoded_reply(node: int, sent: ArrayRecord, arrays: dict, encoding: str, wins: int = 1) -> Message:
    msg = train_reply(node, arrays, {"weight": wins, "num-wins": wins, **COUNTERS})
    msg.content["arrays"] = encode_update(sent, msg.content["arrays"], encoding)
    return msg


def test_the_strategy_decodes_before_checking_and_averaging():
    """Two int8 replies and one fp16 reply are decoded against θ^(t) (in the message itself) before the checks;
    the win-weighted average is within the encodings' bounds of the fp32 one; a reply with a malformed int8 record
    is rejected with the decoder's reason, and a non-finite one by the usual check."""
    strategy = WinWeightedFedAvg(2, 2, wait_seconds=0)
    config = ConfigRecord({"lr": 1e-3, LAYOUT_KEY: layout_of(THETA)})
    list(strategy.configure_train(1, to_record(THETA), config, FakeGrid(2)))
    sent = strategy.current_arrays
    rng = np.random.default_rng(2)
    clients = [{k: (v + 1e-3 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in THETA.items()}
               for _ in range(3)]
    replies = [_encoded_reply(100, sent, clients[0], "int8", wins=1),
               _encoded_reply(101, sent, clients[1], "int8", wins=3),
               _encoded_reply(102, sent, clients[2], "fp16", wins=2)]
    bad = _encoded_reply(103, sent, clients[0], "int8")
    bad.content["arrays"] = ArrayRecord({INT8_KEYS[0]: bad.content["arrays"][INT8_KEYS[0]],
                                         INT8_KEYS[1]: Array(np.ones(9, np.float32))})
    nan = _encoded_reply(104, sent, {k: np.full_like(v, np.nan) for k, v in THETA.items()}, "fp32")
    out, _ = strategy.aggregate_train(1, replies + [bad, nan])
    assert set(strategy.rejected) == {103, 104}
    assert "int8 update: expected int8[192] and float32[3] scales" in strategy.rejected[103]
    assert "non-finite" in strategy.rejected[104]
    assert all(list(r.content["arrays"].keys()) == ["adapter"] for r in replies)  # decoded in place
    got = from_record(out, layout_of(THETA))
    exact = {k: (1 * clients[0][k] + 3 * clients[1][k] + 2 * clients[2][k]) / 6 for k in THETA}
    step = update_norm(THETA, exact)
    assert update_norm(exact, got) <= ENCODING_ERROR["int8"] * step + 1e-6


def test_client_side_dp_clips_then_encodes_and_the_server_accepts_it(monkeypatch):
    """dp = client, int8: the ClientApp's train handler clips (Flower's mod) and then encodes (fedspear's mod, listed
    first). Training moved the adapter by 10; the reply holds the int8 update of the *clipped* update: decoded, its
    norm is C within the int8 bound (encoding first would have left Flower's mod a record it refuses). The server's
    bound C·(1 + 1e-3)·(1 + 8/254) accepts it; the aggregate moves θ by ‖Δ̂‖/m."""
    from fedspear.fl import client_app

    cfg = RunConfig(model="tiny-random", num_clients=8, clients_per_round=4, dp="client", dp_clip_norm=0.5,
                    dp_noise_multiplier=0.0, update_encoding="int8")
    strategy = WinWeightedFedAvg(4, 8, wait_seconds=0, max_update_norm=reply_norm_bound(cfg), dp_denominator=4,
                                 dp_clip_norm=0.5)
    private = PrivateRounds(strategy, cfg)
    assert reply_norm_bound(cfg) == pytest.approx(0.5 * 1.001 * (1 + 8 / 254))
    rng = np.random.default_rng(3)
    direction = {k: rng.standard_normal(v.shape) for k, v in THETA.items()}
    length = math.sqrt(sum(float(np.sum(v ** 2)) for v in direction.values()))

    def fake_round(cfg_, node, arrays, server_round, lr):
        moved = {k: (arrays[k] + direction[k] * 10 / length).astype(np.float32) for k in arrays}
        return moved, {"weight": 2, "num-wins": 2, **COUNTERS}

    monkeypatch.setattr(client_app._RUNNER, "round", fake_round)
    config = ConfigRecord({"lr": 1e-3, "server-round": 1, "fedspear-config": json.dumps(cfg.to_dict()),
                           LAYOUT_KEY: layout_of(THETA), ENCODING_KEY: "int8"})
    message = list(private.configure_train(1, to_record(THETA), config, FakeGrid(8)))[0]
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    reply = client_app.app(message, context)
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    assert tuple(reply.content["arrays"].keys()) == INT8_KEYS
    decoded = from_record(decode_update(message.content["arrays"], reply.content["arrays"]), layout_of(THETA))
    norm = update_norm(THETA, decoded)
    assert abs(norm - 0.5) <= ENCODING_ERROR["int8"] * 0.5 + 1e-6
    clipped = {k: THETA[k] + direction[k] * 0.5 / length for k in THETA}
    assert update_norm(clipped, decoded) <= ENCODING_ERROR["int8"] * 0.5 + 1e-6

    reply.metadata.__dict__["_src_node_id"] = 100
    out, rejected, _ = private.aggregate_train(1, [reply])
    assert rejected == {}
    np.testing.assert_allclose(update_norm(THETA, out), min(norm, 0.5) / 4, rtol=1e-4)


def test_fp32_leaves_the_reply_and_the_config_as_they_were():
    """Default fp32: the mod hands back the very reply it got (no key in the config → nothing happens)."""
    message = Message(content=RecordDict({"arrays": to_record(THETA), "config": ConfigRecord({"lr": 1e-3})}),
                      dst_node_id=1, message_type=MessageType.TRAIN)
    reply = train_reply(1, THETA, {"weight": 1})
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    assert encode_update_mod(message, context, lambda m, c: reply) is reply
    assert list(reply.content["arrays"].keys()) == ["adapter"]
    assert encode_update(to_record(THETA), reply.content["arrays"], "fp32") is reply.content["arrays"]


# ---- bytes on the wire -----------------------------------------------------------------------------------------------
def _reply_of(record: ArrayRecord) -> Message:
    return Message(content=RecordDict({"arrays": record, "metrics": MetricRecord({"weight": 1})}), dst_node_id=1,
                   message_type=MessageType.TRAIN)


def test_wire_bytes_by_hand_and_as_flower_pushes_them():
    """A reply with n float32 values takes 4n bytes of data, numpy's 128-byte .npy header and Flower's object heads:
    n = 2,000 takes exactly 4,000 bytes more than n = 1,000 (same digit counts in every head), and the rest (object
    heads, 64-hex object ids, the tree, the metrics) is under 2,000 bytes: measured 1,187 for one Array, 1,650 for
    the two of an encoded update. int8 takes n + 4⌈n/64⌉ data bytes, fp16 2n + 4. The count equals the bytes
    Flower's own ``push_objects`` hands to the transport, plus the object tree."""
    small, large = (wire_bytes(_reply_of(_flat(np.ones(n)))) for n in (1_000, 2_000))
    assert large - small == 4_000
    assert 4 * 1_000 + 128 < small < 4 * 1_000 + 128 + 2_000
    zeros = _flat(np.zeros(1_000))
    q8 = wire_bytes(_reply_of(encode_update(zeros, _flat(np.ones(1_000)), "int8")))
    h16 = wire_bytes(_reply_of(encode_update(zeros, _flat(np.ones(1_000)), "fp16")))
    assert 1_000 + 4 * 16 + 2 * 128 < q8 < 1_000 + 4 * 16 + 2 * 128 + 2_000  # two Arrays: two .npy headers
    assert 2 * 1_000 + 4 + 2 * 128 < h16 < 2 * 1_000 + 4 + 2 * 128 + 2_000

    msg = _reply_of(_flat(np.arange(1_000)))
    pushed: list[int] = []
    push_objects(get_all_nested_objects(msg), push_object_fn=lambda obj_id, content: pushed.append(len(content)))
    assert wire_bytes(msg) == sum(pushed) + get_object_tree(msg).ByteSize()
    parts = wire_breakdown(msg)
    assert set(parts) == {"arrays", "metrics", "message"} and sum(parts.values()) == wire_bytes(msg)
    assert 4_000 < parts["arrays"] < 4_000 + 128 + 600


def test_round_record_and_tensorboard_carry_the_bytes():
    record = {"round": 1, "clients": [{"node_id": 7, "weight": 1}, {"node_id": 8, "error": "no reply"}]}
    add_wire_bytes(record, {7: 1000, 8: 1000}, {7: 300})
    assert record["clients"][0]["bytes_to_client"] == 1000 and record["clients"][0]["bytes_from_client"] == 300
    assert record["clients"][1]["bytes_to_client"] == 1000 and "bytes_from_client" not in record["clients"][1]
    assert record["bytes_to_clients"] == 2000 and record["bytes_from_clients"] == 300
    tags = scalars(record)
    assert tags["wire/bytes_to_clients"] == 2000 and tags["wire/bytes_from_clients"] == 300


@pytest.mark.slow
def test_a_tiny_int8_run_records_the_bytes_of_every_round(tmp_path):
    """Two rounds of the tiny model through the simulation engine with update_encoding = int8: every round's record
    has the bytes per client and their sums; a client's reply takes n + 4⌈n/64⌉ bytes of data (n adapter values; the
    tiny model's n = 32,768: measured 37,459 bytes with the metrics) and its train message more than 4n; report.md
    shows the section."""
    from safetensors.numpy import load_file

    out = tmp_path / "run"
    cmd = [FEDSPEAR, "run", "--model", "tiny-random", "--rounds", "2", "--clients", "2", "--clients-per-round", "2",
           "--rollouts-per-round", "2", "--eval-size", "4", "--set", "max_new_tokens=4", "--set", "train_size=40",
           "--set", "update_encoding=int8", "-o", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[1] / "src"),
                                                                    os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    n = sum(v.size for v in load_file(out / "adapters" / "round_0000" / "adapter_model.safetensors").values())
    for record in records[1:]:
        assert record["clients_ok"] == 2 and record["aggregated"] is (record["wins"] > 0)  # the zero-win guard
        up = [c["bytes_from_client"] for c in record["clients"]]
        down = [c["bytes_to_client"] for c in record["clients"]]
        assert record["bytes_from_clients"] == sum(up) and record["bytes_to_clients"] == sum(down)
        # data n + 4⌈n/64⌉, two .npy headers, object heads and ids, and the reply's ~40 counters: < 4,000 bytes
        assert all(n + 4 * math.ceil(n / 64) + 2 * 128 < b < n + 4 * math.ceil(n / 64) + 4_000 for b in up), (n, up)
        assert all(b > 4 * n for b in down)
    assert "## On the wire" in (out / "report.md").read_text() and "**int8**" in (out / "report.md").read_text()
