"""The Flower layer: win-weighted aggregation through the real strategy code path, and the ClientApp reply."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

from fedspear.config import RunConfig
from fedspear.fl.records import LAYOUT_KEY, from_record, layout_of, to_record
from fedspear.fl.strategy import WinWeightedFedAvg

pytestmark = pytest.mark.usefixtures("task_identity")


def _reply(delta: float, wins: int, base: np.ndarray) -> Message:
    content = RecordDict({"arrays": to_record({"w": base + delta}),
                          "metrics": MetricRecord({"weight": wins, "num-wins": wins, "num-losses": 0, "prompts": 4})})
    return Message(content=content, dst_node_id=0, message_type=MessageType.TRAIN)


@pytest.mark.parametrize(
    ("wins", "expected_delta"),
    [
        ((1, 1, 1), 37.0),  # (1 + 10 + 100) / 3; the reference code's aliasing gives +100
        ((1, 0, 3), 75.25),  # (1·1 + 0·10 + 3·100) / 4
        ((0, 0, 0), 0.0),  # zero-win guard: the global adapter is kept unchanged (SPEC §4)
    ],
)
def test_win_weighted_fedavg_through_the_strategy(wins, expected_delta):
    base = np.arange(6, dtype=np.float32).reshape(2, 3)
    strategy = WinWeightedFedAvg(clients_per_round=3, min_available_nodes=3)
    strategy.current_arrays, strategy.current_layout = to_record({"w": base}), layout_of({"w": base})
    replies = [_reply(d, w, base) for d, w in zip((1.0, 10.0, 100.0), wins)]
    arrays, metrics = strategy.aggregate_train(1, replies)
    out = from_record(arrays, layout_of({"w": base}))["w"]
    np.testing.assert_allclose(out, base + expected_delta, rtol=0, atol=1e-5)
    assert metrics["num-wins"] == sum(wins)
    out[0, 0] = -1  # the result is a copy, not a view of any reply
    assert from_record(replies[0].content["arrays"], layout_of({"w": base}))["w"][0, 0] == base[0, 0] + 1.0


def test_sampling_is_seeded_and_waits_boundedly():
    class Grid:
        def __init__(self, n):
            self.n = n

        def get_node_ids(self):
            return list(range(10, 10 + self.n))[::-1]

    s = WinWeightedFedAvg(clients_per_round=3, min_available_nodes=5, seed=7, wait_seconds=0.0)
    assert s.sample(Grid(5), 1) == s.sample(Grid(5), 1)
    assert len(set(s.sample(Grid(5), 2))) == 3
    with pytest.raises(RuntimeError, match="only 2 of the 5 required nodes connected"):
        s.sample(Grid(2), 1)


def test_client_app_replies_with_adapter_copies_and_counters(monkeypatch, always_right):
    """One ClientApp call on the tiny model: the reply carries every LoRA tensor (all moved), num-wins, counters,
    and no text (only arrays and numbers)."""
    import fedspear.worker as client_module
    from fedspear.fl import client_app

    monkeypatch.setattr(client_module, "make_feedback", lambda task, *args, **kwargs: always_right)
    cfg = RunConfig(model="tiny-random", num_clients=2, clients_per_round=1, rollouts_per_round=3, local_steps=2,
                    batch_size=2, lr=1e-2, max_new_tokens=3, lora_r=4, lora_alpha=8)
    worker = client_app.get_worker(cfg)
    from fedspear.runtime.model import get_adapter

    start = get_adapter(worker.model)
    msg = Message(
        content=RecordDict({
            "arrays": to_record(start),
            "config": ConfigRecord({"server-round": 1, "lr": 1e-2, "fedspear-config": json.dumps(cfg.to_dict()),
                                    LAYOUT_KEY: layout_of(start)}),
        }),
        dst_node_id=1, message_type=MessageType.TRAIN,
    )
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 1, "num-partitions": 2}, state=RecordDict(),
                      run_config={})
    reply = client_app.train(msg, context)
    arrays = from_record(reply.content["arrays"], layout_of(start))
    metrics = dict(reply.content["metrics"])
    assert set(arrays) == set(start)
    assert all(not np.array_equal(arrays[k], start[k]) for k in start)
    assert metrics["num-wins"] == 3 and metrics["prompts"] == 3 and metrics["steps"] == 2
    assert metrics["partition-id"] == 1
    assert all(isinstance(v, (int, float)) for v in metrics.values())
    # copies: the worker's live adapter can change without touching the reply
    live = get_adapter(worker.model)
    assert all(np.array_equal(live[k], arrays[k]) for k in arrays)
    import torch

    with torch.no_grad():
        for p in worker.model.parameters():
            if p.requires_grad:
                p.zero_()
    assert all(not np.array_equal(from_record(reply.content["arrays"], layout_of(start))[k], 0)
               for k in arrays if "lora_A" in k)


def test_partition_id_out_of_range_is_a_clear_error():
    from fedspear.fl.client_app import partition_of

    cfg = RunConfig(model="tiny-random", num_clients=2, clients_per_round=1)
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 5}, state=RecordDict(), run_config={})
    with pytest.raises(ValueError, match=r"partition-id 5 is outside 0..1"):
        partition_of(context, cfg, worker=None)


def test_no_raw_text_leaves_the_client(monkeypatch):
    """Wire privacy: the reply holds only LoRA tensors and numbers; no prompt, answer, hint or fact text appears in
    its serialised bytes (checked against every text the client saw or produced this round)."""
    import fedspear.algorithms.spear as client_module
    from flwr.common.serde import recorddict_to_proto

    from fedspear.fl import client_app
    from fedspear.interaction import interact as real_interact

    seen: list[str] = []

    def spying_interact(model, tokenizer, examples, task, feedback_source, **kw):
        result = real_interact(model, tokenizer, examples, task, feedback_source, **kw)
        for ex in examples:
            seen.extend([ex.question, *ex.options, task.prompt(ex)])
        for t in result.wins + result.losses:
            seen.append(tokenizer.decode(t.completion_ids, skip_special_tokens=True))
        return result

    monkeypatch.setattr(client_module, "interact", spying_interact)
    cfg = RunConfig(model="tiny-random", num_clients=2, clients_per_round=1, rollouts_per_round=3, local_steps=1,
                    batch_size=2, max_new_tokens=3, lora_r=4, lora_alpha=8)
    worker = client_app.get_worker(cfg)
    from fedspear.runtime.model import get_adapter

    start = get_adapter(worker.model)
    msg = Message(
        content=RecordDict({
            "arrays": to_record(start),
            "config": ConfigRecord({"server-round": 1, "lr": 1e-3, "fedspear-config": json.dumps(cfg.to_dict()),
                                    LAYOUT_KEY: layout_of(start)}),
        }),
        dst_node_id=1, message_type=MessageType.TRAIN,
    )
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    reply = client_app.train(msg, context)
    assert set(reply.content.keys()) == {"arrays", "metrics"}
    assert not reply.content.config_records
    assert list(reply.content["arrays"].keys()) == ["adapter"]  # packed, layout in the config: test_adapter_packing
    assert all(k.startswith("base_model.") and "lora_" in k
               for k in from_record(reply.content["arrays"], layout_of(start)))
    wire = recorddict_to_proto(reply.content).SerializeToString()
    texts = [t for t in seen if len(t.strip()) >= 12]
    assert texts, "the spy saw no text"
    leaked = [t for t in texts if t.encode() in wire]
    assert not leaked, leaked[:2]


def test_adapter_packing_round_trips_and_refuses_bad_layouts():
    """``to_record`` sends one flat float Array, its layout travels as JSON text (``layout_of``, in the train
    config); ``from_record`` restores names, order, shapes, dtype and values as copies, reads per-tensor records
    too, and refuses a layout that does not match its buffer."""
    from flwr.app import Array, ArrayRecord

    arrays = {"b.lora_B": np.zeros((3, 2), np.float32), "a.lora_A": np.arange(6, dtype=np.float32).reshape(2, 3),
              "s": np.float32(2.5).reshape(())}
    record, layout = to_record(arrays), layout_of(arrays)
    assert list(record.keys()) == ["adapter"] and list(record["adapter"].shape) == [13]  # 6 + 6 + 1 values
    assert record["adapter"].dtype == "float32"  # only float data: Flower's DP clipping and noise can act on it
    out = from_record(record, layout)
    assert list(out) == list(arrays)
    assert all(out[k].shape == arrays[k].shape and out[k].dtype == np.float32 for k in arrays)
    assert all(np.array_equal(out[k], arrays[k]) for k in arrays)
    out["a.lora_A"][0, 0] = -1  # a copy: neither the source nor the record changes
    assert arrays["a.lora_A"][0, 0] == 0 and from_record(record, layout)["a.lora_A"][0, 0] == 0
    mixed = {"x": np.zeros(2, np.float32), "y": np.zeros(2, np.float64)}
    assert layout_of(mixed) is None
    assert list(to_record(mixed).keys()) == ["x", "y"] and from_record(to_record(mixed))["y"].dtype == np.float64
    with pytest.raises(ValueError, match="no layout given"):
        from_record(record)

    flat = np.zeros(6, np.float32)
    for bad, message in [
        ('{"dtype": "float32", "tensors": [["w", [2, 2]]]}', "shapes hold 4 values, the buffer 6"),
        ('{"dtype": "float64", "tensors": [["w", [6]]]}', "layout says flat float64"),
        ('{"dtype": "float32", "tensors": [["w", [3]], ["w", [3]]]}', "repeated tensor names"),
        ('{"dtype": "float32", "tensors": [["w", [-6]]]}', "negative dimensions"),
        ("not json", "unreadable layout"),
    ]:
        with pytest.raises(ValueError, match=message):
            from_record(ArrayRecord({"adapter": Array(flat)}), bad)
    with pytest.raises(ValueError, match="expected the single Array 'adapter'"):
        from_record(ArrayRecord({"adapter": Array(flat), "adapter-layout": Array(np.zeros(3, np.uint8))}),
                    '{"dtype": "float32", "tensors": [["w", [6]]]}')

    # the strategy decodes replies with the layout it broadcast: a reply of another size is excluded with the
    # reason, the others are aggregated
    base = {"w": np.zeros(6, np.float32)}
    strategy = WinWeightedFedAvg(clients_per_round=2, min_available_nodes=2)
    strategy.current_arrays, strategy.current_layout = to_record(base), layout_of(base)
    good = _reply(1.0, 2, base["w"])
    bad = Message(content=RecordDict({"arrays": to_record({"w": np.zeros(5, np.float32)}), "metrics": MetricRecord(
        {"weight": 1, "num-wins": 1, "num-losses": 0, "prompts": 4})}), dst_node_id=0, message_type=MessageType.TRAIN)
    out, _ = strategy.aggregate_train(1, [good, bad])
    np.testing.assert_allclose(from_record(out, layout_of(base))["w"], 1.0)
    assert list(strategy.rejected.values()) == [
        "packed adapter: the layout's tensor shapes hold 6 values, the buffer 5"]


def test_round0_is_reused_only_from_a_run_whose_start_is_known_to_be_the_identity(tmp_path):
    """``round0_from`` borrows the base model's evaluation when the source's settings agree and its start adapter was
    the identity: shown by its round-0 adapter on disk, or — for a copied result without adapters, such as a committed
    grid cell — by the ``start_identity`` its round 0 recorded. Without either, or with a trained (non-zero B) start,
    other evaluation settings, another precision, another device, answers decoded at another batch or a decode
    compiled in one run and eager in the other, the run evaluates round 0 itself."""
    from fedspear.fl.server_app import reused_round0
    from fedspear.rundir import RunDir

    identity = {"m.lora_A.weight": np.ones((2, 3), np.float32), "m.lora_B.weight": np.zeros((3, 2), np.float32)}
    trained = {**identity, "m.lora_B.weight": np.full((3, 2), 0.5, np.float32)}
    evaluation = {"n": 4, "correct_gen": "1010", "acc_gen": 0.5, "seconds_evaluate": 3.0, "batch_size": 32}

    def source(name, record_extra, adapter=None, evaluated=evaluation, **settings):
        run = RunDir(tmp_path / name)
        run.check_or_write_config(RunConfig(**settings).resolved())
        run.append({"round": 0, "eval": evaluated, "dtype": "fp32", **record_extra})
        if adapter is not None:
            run.save_adapter(0, adapter, None)
        return run

    def borrow(run, dtype_used="fp32", device="cpu", rows=32, **changes):
        return reused_round0(RunConfig(round0_from=str(run.path), **changes).resolved(), identity, dtype_used, device,
                             rows)

    copied = source("copied", {"start_identity": True})  # metrics.jsonl + config.toml, no adapters
    assert copied.serves_round0() and copied.serves_round0("fp32", "cpu")
    assert not copied.serves_round0("bf16", "cpu") and not copied.serves_round0("fp32", "cuda")
    assert borrow(copied) == {**evaluation, "reused_from": str(copied.path)}
    assert borrow(copied, eval_size=evaluation["n"] + 1) is None  # another evaluation subset
    assert borrow(copied, rows=64) is None  # its answers decoded at 32, this run's would at 64
    # a record from before eval_batch_size = "auto" does not say: the number its config names does
    before = {k: v for k, v in evaluation.items() if k != "batch_size"}
    assert borrow(source("before-auto", {"start_identity": True}, evaluated=before, eval_batch_size=32))["n"] == 4
    assert borrow(source("before-64", {"start_identity": True}, evaluated=before, eval_batch_size=64)) is None
    assert borrow(copied, dtype_used="bf16") is None  # `auto` resolved otherwise on this machine
    assert borrow(copied, device="cuda") is None  # a record without `device` is a CPU run
    assert reused_round0(RunConfig(round0_from=str(copied.path)).resolved(), trained, "fp32", "cpu") is None
    on_gpu = source("on-gpu", {"start_identity": True, "device": "cuda"})
    assert borrow(on_gpu) is None and borrow(on_gpu, device="cuda")["reused_from"] == str(on_gpu.path)
    # compile_decode as it resolves on the device: the source's `auto` compiles on a GPU, not on the CPU
    assert borrow(on_gpu, device="cuda", compile_decode="off") is None
    assert borrow(on_gpu, device="cuda", compile_decode="on")["reused_from"] == str(on_gpu.path)
    assert borrow(copied, compile_decode="off")["reused_from"] == str(copied.path)
    assert borrow(copied, compile_decode="on") is None

    legacy = source("legacy", {})  # written before runs recorded their start: unprovable without the adapter
    assert not legacy.serves_round0() and borrow(legacy) is None
    on_disk = source("on-disk", {}, adapter=identity)
    assert on_disk.serves_round0() and borrow(on_disk)["reused_from"] == str(on_disk.path)
    bad_start = source("bad-start", {"start_identity": True}, adapter=trained)  # the adapter on disk decides
    assert borrow(bad_start) is None
    (copied.path / "config.toml").unlink()  # no settings to compare with
    assert not copied.serves_round0() and borrow(copied) is None


def test_partition_discovery_leaves_out_replies_it_cannot_read(caplog):
    """One node's malformed answer to the partition query (no metric record, a non-integer id) leaves that node out
    with a warning instead of ending the server; a node without a partition (-1) is left out quietly."""
    from types import SimpleNamespace

    from flwr.app import MetricRecord

    from fedspear.fl.server_app import discover_partitions

    def reply(node, *records, error=False):
        return SimpleNamespace(has_error=lambda: error, metadata=SimpleNamespace(src_node_id=node),
                               content=SimpleNamespace(metric_records={f"m{i}": r for i, r in enumerate(records)}))

    replies = [reply(1, MetricRecord({"partition-id": 0})), reply(2), reply(3, MetricRecord({"partition-id": 1.5})),
               reply(4, MetricRecord({"partition-id": 2})), reply(5, error=True),
               reply(6, MetricRecord({"partition-id": -1}))]
    grid = SimpleNamespace(get_node_ids=lambda: [1, 2, 3, 4, 5, 6], send_and_receive=lambda messages, timeout: replies)
    with caplog.at_level("WARNING", logger="fedspear"):
        assert discover_partitions(grid, 6, timeout=1) == {1: 0, 4: 2}
    assert [r.getMessage() for r in caplog.records] == [
        f"node {n} answered the partition query without an integer partition-id; left out" for n in (2, 3)]
    # two SuperNodes started with one partition-id: both trained it and another none, silently
    replies.append(reply(7, MetricRecord({"partition-id": 2})))
    grid.get_node_ids = lambda: [1, 2, 3, 4, 5, 6, 7]
    from fedspear.config import ConfigError

    with pytest.raises(ConfigError, match=r"partition-id 2 is set on nodes 4, 7: give each SuperNode its own "
                                          r"\(--node-config 'partition-id=K', K in 0..6\)"):
        discover_partitions(grid, 7, timeout=1)


@pytest.mark.parametrize(("code", "dropped"), [
    ("CLIENT_APP_RAISED_EXCEPTION", False), ("MOD_FAILED_PRECONDITION", False), ("LOAD_CLIENT_APP_EXCEPTION", False),
    ("NODE_UNAVAILABLE", True), ("CLIENT_APP_CRASHED", True)])
def test_an_error_raised_by_the_client_or_its_mods_is_not_a_drop_out(code, dropped):
    """Error replies from the client's own code, its mods' included (a DP clipping mod's failed precondition), are
    rejected as errors, which max_empty_rounds never tolerates; the node's absence or a crash counts as a drop-out."""
    from types import SimpleNamespace

    from flwr.common.constant import ErrorCode

    strategy = WinWeightedFedAvg(clients_per_round=1, min_available_nodes=1)
    msg = SimpleNamespace(has_error=lambda: True, error=SimpleNamespace(code=getattr(ErrorCode, code), reason="why"),
                          metadata=SimpleNamespace(src_node_id=7))
    accepted, rejected, drops = strategy._check_replies([msg], None)
    assert accepted == [] and rejected == {7: "client error: why"} and drops == ({7} if dropped else set())
