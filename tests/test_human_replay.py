"""Training on people's feedback: stored chat trajectories replayed through SPEAR's win / lose split (tiny model),
marked used, and nothing of their text on the wire."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from fedspear.config import RunConfig
from fedspear.fl.records import LAYOUT_KEY, from_record, layout_of, to_record
from fedspear.human.replay import HumanFeedback, as_example, client_round
from fedspear.interaction import render
from fedspear.runtime.model import get_adapter
from fedspear.human.store import TraceStore

PROMPTS = ["What do bees make from nectar? (a question asked in the chat)",
           "Which planet is called the red planet? (another chat question)",
           "How many legs does a spider have? (a third chat question)",
           "An unanswered question that is still open in the chat"]
HINTS = {"b": "Think of the colour of rust, the hint typed by the person",
         "c": "Count the legs of an insect and add two, a second typed hint"}


def cfg_for(**overrides) -> RunConfig:
    base = dict(model="tiny-random", num_clients=2, clients_per_round=1, rollouts_per_round=8, local_steps=2,
                batch_size=2, lr=1e-2, max_new_tokens=4, lora_r=4, lora_alpha=8, lora_dropout=0.0, train_size=40,
                max_revisions=2)
    base.update(overrides)
    return RunConfig(**base)


def fill(store: TraceStore, tokenizer) -> dict[str, list[int]]:
    """a: y0 right. b: y0 wrong + hint, y1 right. c: y0 wrong + hint, y1 wrong, person stops. d: open, unjudged."""
    eos = tokenizer.eos_token_id

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False) + [eos]

    texts = {"a0": "Bees make honey from nectar, an answer", "b0": "Venus is the red planet, a wrong answer",
             "b1": "Mars is the red planet, the revised answer", "c0": "A spider has six legs, a wrong answer",
             "c1": "A spider has ten legs, still a wrong answer", "d0": "An answer nobody has judged yet"}
    tok = {k: ids(v) for k, v in texts.items()}
    a = store.open(PROMPTS[0], "tiny")
    store.add_attempt(a, texts["a0"], tok["a0"], True)
    store.judge(a, True)
    b = store.open(PROMPTS[1], "tiny")
    store.add_attempt(b, texts["b0"], tok["b0"], True)
    store.judge(b, False, HINTS["b"])
    store.add_attempt(b, texts["b1"], tok["b1"], True)
    store.judge(b, True)
    c = store.open(PROMPTS[2], "tiny")
    store.add_attempt(c, texts["c0"], tok["c0"], True)
    store.judge(c, False, HINTS["c"])
    store.add_attempt(c, texts["c1"], tok["c1"], True)
    store.judge(c, False)
    d = store.open(PROMPTS[3], "tiny")
    store.add_attempt(d, texts["d0"], tok["d0"], True)
    return {"texts": texts, "ids": tok, "trajectories": [a, b, c, d]}


@pytest.fixture
def worker():
    from fedspear.worker import Worker

    w = Worker.load(cfg_for())
    return w


def test_replay_gives_spears_win_and_lose_sets_and_marks_used(worker, tmp_path, monkeypatch):
    """The person's verdicts decide exactly as the oracle would in simulation (paper Alg. 1): a → win y0; b → win
    y1 from c0, lose y0 with α = 1; c → lose y0 with α = 0.5; d (open) is not touched. Nothing is generated."""
    import fedspear.algorithms.spear as spear_module

    store = TraceStore(tmp_path / "traces.db")
    stored = fill(store, worker.tokenizer)
    seen = {}
    real = spear_module.local_train

    def spy(model, tokenizer, wins, losses, *args, **kwargs):
        seen["wins"], seen["losses"] = wins, losses
        return real(model, tokenizer, wins, losses, *args, **kwargs)

    monkeypatch.setattr(spear_module, "local_train", spy)
    start = get_adapter(worker.model)
    rng = np.random.default_rng(0)
    start = {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in start.items()}
    from fedspear.runtime.model import set_adapter

    set_adapter(worker.model, start)
    metrics = client_round(worker, worker.loaded, store, lr=1e-2, seed=1, server_round=5)
    ids = stored["ids"]
    assert [w.completion_ids for w in seen["wins"]] == [ids["a0"], ids["b1"]]
    assert [(t.completion_ids, t.alpha) for t in seen["losses"]] == [(ids["b0"], 1.0), (ids["c0"], 0.5)]
    c0 = render(worker.tokenizer, [PROMPTS[1]])
    assert seen["wins"][1].prompt_ids == c0 and seen["losses"][0].prompt_ids == c0  # learnt from the original c0
    assert metrics["num-wins"] == 2 and metrics["num-losses"] == 2 and metrics["weight"] == 2
    assert metrics["human-trajectories"] == 3 and metrics["replayed_attempts"] == 5
    assert metrics["generations"] == 0 and metrics["revisions_successful"] == 1
    after = get_adapter(worker.model)
    assert max(float(np.abs(after[k] - start[k]).max()) for k in start) > 1e-6
    a, b, c, d = stored["trajectories"]
    assert [store.get(t).used_in_round for t in (a, b, c, d)] == [5, 5, 5, None]
    # nothing left to learn: weight 0, adapter untouched
    again = client_round(worker, worker.loaded, store, lr=1e-2, seed=2, server_round=6)
    assert again["weight"] == 0 and again["human-trajectories"] == 0
    assert all(np.array_equal(get_adapter(worker.model)[k], after[k]) for k in after)


def test_revisions_beyond_the_runs_budget_are_not_replayed(worker, tmp_path):
    """max_revisions = 0 on the node: b's successful revision cannot count, so b is a lose trace with α = 0.5."""
    store = TraceStore(tmp_path / "traces.db")
    fill(store, worker.tokenizer)
    metrics = client_round(worker, cfg_for(max_revisions=0).resolved(), store, lr=1e-2, seed=1, server_round=1)
    assert metrics["num-wins"] == 1 and metrics["num-losses"] == 2 and metrics["replayed_attempts"] == 3


def test_human_feedback_is_a_lookup_of_what_the_person_said(worker, tmp_path):
    store = TraceStore(tmp_path / "traces.db")
    stored = fill(store, worker.tokenizer)
    trajs = store.trajectories(trainable_only=True)
    decode = lambda ids: worker.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    fb = HumanFeedback(trajs, decode)
    b = as_example(trajs[1])
    assert fb.is_correct(b, decode(stored["ids"]["b0"])) is False
    assert fb.feedback(b, decode(stored["ids"]["b0"])) == HINTS["b"]
    assert fb.is_correct(b, decode(stored["ids"]["b1"])) is True
    with pytest.raises(KeyError, match="no stored attempt"):
        fb.is_correct(b, "something the model never said")
    with pytest.raises(KeyError, match="no hint"):
        fb.feedback(b, decode(stored["ids"]["b1"]))


def test_only_algorithms_that_learn_from_traces_are_allowed(worker, tmp_path):
    store = TraceStore(tmp_path / "traces.db")
    fill(store, worker.tokenizer)
    with pytest.raises(ValueError, match="cannot train on human trajectories"):
        client_round(worker, cfg_for(algorithm="grpo").resolved(), store, lr=1e-2, seed=1, server_round=1)
    assert store.counts()["used"] == 0  # refused before touching the store


@pytest.mark.usefixtures("task_identity")
def test_a_human_nodes_reply_carries_no_prompt_answer_or_hint(tmp_path):
    """Through the ClientApp with node config trace-db: the serialised reply holds none of the stored texts, and
    the trajectories are marked used by this round."""
    from flwr.common.serde import recorddict_to_proto

    from fedspear.fl import client_app

    cfg = cfg_for()
    worker = client_app.get_worker(cfg)
    store = TraceStore(tmp_path / "traces.db")
    stored = fill(store, worker.tokenizer)
    layout = layout_of(get_adapter(worker.model))
    msg = Message(
        content=RecordDict({
            "arrays": to_record(get_adapter(worker.model)),
            "config": ConfigRecord({"server-round": 2, "lr": 1e-3, "fedspear-config": json.dumps(cfg.to_dict()),
                                    LAYOUT_KEY: layout}),
        }),
        dst_node_id=1, message_type=MessageType.TRAIN,
    )
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "trace-db": str(store.path)},
                      state=RecordDict(), run_config={})
    reply = client_app.train(msg, context)
    metrics = dict(reply.content["metrics"])
    assert metrics["human-trajectories"] == 3 and metrics["num-wins"] == 2
    assert set(reply.content.keys()) == {"arrays", "metrics"}
    assert set(from_record(reply.content["arrays"], layout)) == set(get_adapter(worker.model))
    wire = recorddict_to_proto(reply.content).SerializeToString()
    texts = PROMPTS + list(HINTS.values()) + list(stored["texts"].values())
    leaked = [t for t in texts if t.encode() in wire or t[:20].encode() in wire]
    assert not leaked, leaked
    assert store.counts()["used"] == 3
    # the federation's adapter is kept beside the trace store for `fedspear chat --adapter`
    from safetensors.numpy import load_file

    saved = load_file(tmp_path / "global_adapter" / "adapter_model.safetensors")
    assert len(saved) == len(from_record(reply.content["arrays"], layout)) and (tmp_path / "global_adapter" /
                                                                         "adapter_config.json").is_file()
    from fedspear.human.chat import ChatModel

    chat = ChatModel.load("tiny-random", "fp32", adapter=tmp_path / "global_adapter", max_new_tokens=3)
    assert chat.version.startswith("tiny-random+global_adapter@")
    with pytest.raises(FileNotFoundError, match="no peft adapter"):
        ChatModel.load("tiny-random", "fp32", adapter=tmp_path / "nowhere")
