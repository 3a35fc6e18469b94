"""FedAdam / FedYogi through the strategy code path (moments kept across rounds, zero-win rounds skipped, state
checkpointed with the adapter), and FedProx's proximal pull in local training."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Message, MessageType, MetricRecord, RecordDict

from fedspear.fl.strategy import WinWeightedFedAvg
from fedspear.fl.records import from_record, layout_of, to_record
from fedspear.rundir import RunDir
from fedspear.server.server_opt import ServerOptState, arrays_to_state, fedadam_step, fedyogi_step, state_to_arrays

pytestmark = pytest.mark.usefixtures("task_identity")


def _reply(arrays, wins):
    content = RecordDict({"arrays": to_record(arrays),
                          "metrics": MetricRecord({"weight": wins, "num-wins": wins, "num-losses": 0, "prompts": 4})})
    return Message(content=content, dst_node_id=0, message_type=MessageType.TRAIN)


@pytest.mark.parametrize(("name", "step"), [("fedadam", fedadam_step), ("fedyogi", fedyogi_step)])
def test_server_optimiser_through_the_strategy(name, step):
    rng = np.random.default_rng(0)
    theta = {"w": rng.normal(size=(3, 4)).astype(np.float32)}
    strategy = WinWeightedFedAvg(2, 2, server_opt=name, server_lr=0.01)
    ref_theta, ref_state = dict(theta), ServerOptState()
    for t, wins in enumerate([(1, 3), (0, 0), (2, 2)], start=1):
        strategy.current_arrays, strategy.current_layout = to_record(theta), layout_of(theta)
        clients = [{"w": theta["w"] + rng.normal(size=(3, 4)).astype(np.float32)} for _ in wins]
        out = from_record(strategy.aggregate_train(t, [_reply(c, w) for c, w in zip(clients, wins)])[0],
                          layout_of(theta))
        if sum(wins):  # the expected value: win-weighted mean, then one server step
            avg = {"w": (clients[0]["w"] * wins[0] + clients[1]["w"] * wins[1]) / sum(wins)}
            ref_theta, ref_state = step(ref_theta, avg, ref_state, eta=0.01, beta1=0.9, beta2=0.99, tau=0.005)
        np.testing.assert_allclose(out["w"], ref_theta["w"], rtol=1e-5, atol=1e-6)
        theta = out
    assert strategy.opt_state.step == ref_state.step == 2  # the zero-win round took no server step


def test_server_state_is_checkpointed_with_the_adapter(tmp_path):
    run = RunDir(tmp_path)
    state = ServerOptState(m={"w": np.ones(3)}, v={"w": np.full(3, 2.0)}, step=4)
    run.save_adapter(5, {"w": np.zeros(3, np.float32)}, None, server_state=state_to_arrays(state))
    back = arrays_to_state(run.load_server_state(5))
    assert back.step == 4 and np.array_equal(back.v["w"], state.v["w"])
    assert run.load_server_state(4) is None
    parsed = run.server_opt_state(5)  # what a resume restores: the same moments, parsed in one place
    assert parsed.step == 4 and np.array_equal(parsed.m["w"], state.m["w"]) and run.server_opt_state(4) is None


def test_fedprox_pulls_the_local_update_towards_the_global_adapter(tiny, arc_items, always_right):
    from fedspear.interaction import interact
    from fedspear.runtime.model import get_adapter, set_adapter
    from fedspear.tasks import arc_challenge
    from fedspear.training import TrainSettings, local_train
    from fedspear.server.validation import update_norm

    model, tok = tiny
    start = get_adapter(model)
    res = interact(model, tok, arc_items, arc_challenge, always_right, max_new_tokens=4, seed=0)
    norms = {}
    for mu in (0.0, 1e4):
        set_adapter(model, start)
        local_train(model, tok, res.wins, [], TrainSettings(local_steps=3, batch_size=3, prox_mu=mu), lr=1e-2, seed=0)
        norms[mu] = update_norm(start, get_adapter(model))
    set_adapter(model, start)
    assert 0 < norms[1e4] < norms[0.0]
