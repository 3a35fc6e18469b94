"""Issue 16, part 5: the prompt/label boundary without a chat template, OPSD's T² factor, and the dropout mode of the
ratio-based baselines (GRPO, RLTF-SD)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from fedspear import baseline_losses
from fedspear.algorithms import feedback_sft, grpo, opsd, rltf_sd, spear
from fedspear.config import RunConfig
from fedspear.evaluation import label_token_ids, loglik_predictions, next_token_logits
from fedspear.interaction import render
from fedspear.tasks import arc_challenge, hellaswag, math_mcqa, strategy_qa
from fedspear.training import dropout_modules

from helpers import Alternate, make_worker, nonzero_start

TOL = 1e-5


@pytest.fixture(scope="module")
def plain_tokenizer(tiny):
    """The tiny model's tokenizer with ``chat_template = None`` (a base model's tokenizer)."""
    tok = copy.deepcopy(tiny[1])
    tok.chat_template = None
    return tok


# ----------------------------------------------------------------------------------------------------------------------
# render without a chat template: the scored label follows the rendered prompt
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", [arc_challenge, hellaswag], ids=["arc_challenge", "hellaswag"])
def test_plain_prompt_ends_in_answer_cue_and_scored_label_continues_it(task, plain_tokenizer):
    """Without a chat template an ARC / HellaSwag prompt ends in "Answer:" (no blank line after it), and for every
    label L the tokenisation of ``prompt + " L"`` is exactly ``render(prompt) + [label_token_ids(L)]``: the id the
    scorer compares is the token that continues the prompt the model sees."""
    tok = plain_tokenizer
    for ex in task.load("train" if task is arc_challenge else "validation")[:3]:
        prompt = task.prompt(ex)
        ids = render(tok, [prompt])
        assert tok.decode(ids).endswith("Answer:") and not tok.decode(ids).endswith("\n")
        labels = label_token_ids(tok, ex.labels)
        assert [tok.decode([i]) for i in labels] == [f" {label}" for label in ex.labels]
        for label, label_id in zip(ex.labels, labels):
            assert tok(f"{prompt} {label}", add_special_tokens=True)["input_ids"] == ids + [label_id]


def test_plain_rendering_elsewhere_keeps_blank_lines(plain_tokenizer):
    """Prompts that do not end in a colon (MathMCQA options, a StrategyQA question) and revision contexts
    c_n = c0 ‖ y_prev ‖ f_n keep the blank-line joins and the closing blank line (SPEC §2 Decision)."""
    tok = plain_tokenizer
    math_prompt = math_mcqa.PROMPT_TEMPLATE.format(problem="1 + 1?", options="A) 1\nB) 2\nC) 3\nD) 4", letters="A-D")
    strategy_prompt = strategy_qa.PROMPT_TEMPLATE.format(question="Is water wet?")
    for prompt in (math_prompt, strategy_prompt):
        assert render(tok, [prompt]) == tok(prompt + "\n\n")["input_ids"]
    arc_prompt = arc_challenge.prompt(arc_challenge.load("train")[0])
    turns = [arc_prompt, " B", "Incorrect. 'B' is wrong.\nDO NOT choose the answer you used previously."]
    assert render(tok, turns) == tok("\n\n".join(turns) + "\n\n")["input_ids"]


def test_chat_template_rendering_and_labels_unchanged(tiny, arc_items):
    """With a chat template: the template's own tokens (generation prompt included) and bare label tokens "A".."D"."""
    tok = tiny[1]
    assert tok.chat_template
    prompt = arc_challenge.prompt(arc_items[0])
    expected = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert render(tok, [prompt]) == list(expected)
    assert label_token_ids(tok, ["A", "B", "C", "D"]) == [tok.encode(x, add_special_tokens=False)[0] for x in "ABCD"]


def test_plain_loglik_scores_equal_a_forward_over_prompt_plus_label(tiny, plain_tokenizer, arc_items):
    """End to end without a chat template: the log-likelihood scorer's logits for " A".." D" equal those of one
    plain forward over the tokenised ``prompt + " A"`` at the position predicting " A" (so the prediction is the
    argmax of exactly those continuations)."""
    model, tok = tiny[0], plain_tokenizer
    items = arc_items[:3]
    contexts = [render(tok, [arc_challenge.prompt(ex)]) for ex in items]
    scored = next_token_logits(model, tok, contexts)  # [N, V]
    predictions = loglik_predictions(model, tok, items, arc_challenge)
    model.eval()
    for row, ex, pred in zip(scored, items, predictions):
        ids = tok(f"{arc_challenge.prompt(ex)} {ex.labels[0]}")["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -2].float()  # [V] predicting the label token
        label_ids = label_token_ids(tok, ex.labels)
        assert ids[-1] == label_ids[0]
        assert torch.allclose(row[label_ids], logits[label_ids], atol=1e-4)
        assert pred == ex.labels[int(logits[label_ids].argmax())]


# ----------------------------------------------------------------------------------------------------------------------
# OPSD: the authors' variant carries the T² factor (SPEC §5, §8)
# ----------------------------------------------------------------------------------------------------------------------

Z_S = torch.tensor([[[2.0, 0.0, -1.0]]])  # [B=1, C=1, V=3]
Z_T = torch.tensor([[[0.0, 1.0, 0.0]]])
ONE = torch.tensor([[True]])


def test_opsd_authors_variant_is_t2_times_forward_kl():
    """SPEC §8, through ``opsd.loss`` with the ``authors`` settings (forward KL, T = 2, T² on):
    T = 2: P_S = softmax([1, 0, -0.5]) = [0.628532, 0.231224, 0.140244], P_T = softmax([0, 0.5, 0]) =
    [0.274069, 0.451863, 0.274069]; KL(T||S) = 0.258889; x T^2 = 4 * 0.258889 = 1.035556.
    Gradient w.r.t. z_S: d KL_T / d z_S = (P_S - P_T) / T = [0.354463, -0.220639, -0.133825] / 2
    = [0.177232, -0.110320, -0.066913]; x 4 = [0.708926, -0.441278, -0.267650].
    The ``original`` variant (JSD beta 0.5, T 1.1, no T^2) gives SPEC §8's 0.187228."""
    s = opsd.settings(RunConfig(opsd_variant="authors").resolved())
    assert (s.divergence, s.temperature, s.teacher, s.t2_scaling) == ("forward_kl", 2.0, "current", True)
    student = Z_S.clone().requires_grad_(True)
    value = opsd.loss(student, Z_T, ONE, s)
    assert value.item() == pytest.approx(1.035556, abs=TOL)
    value.backward()
    assert student.grad[0, 0].tolist() == pytest.approx([0.708926, -0.441278, -0.267650], abs=TOL)

    plain = Z_S.clone().requires_grad_(True)
    unscaled = opsd.loss(plain, Z_T, ONE, dataclasses.replace(s, t2_scaling=False))
    unscaled.backward()
    assert unscaled.item() == pytest.approx(0.258889, abs=TOL)
    assert torch.allclose(student.grad, 4.0 * plain.grad, atol=1e-6)

    original = opsd.settings(RunConfig().resolved())
    assert original.t2_scaling is False
    assert opsd.loss(Z_S, Z_T, ONE, original).item() == pytest.approx(0.187228, abs=TOL)


def test_opsd_round_uses_the_variant_t2_scaling(arc_items, always_right, monkeypatch):
    """The client loop goes through ``opsd.loss``: each variant's micro-steps call ``distill_loss`` with its own
    divergence, temperature and T² setting."""
    calls = []
    real = baseline_losses.distill_loss

    def spy(*args, **kwargs):
        calls.append((args[3], args[5], kwargs.get("t2_scaling")))
        return real(*args, **kwargs)

    monkeypatch.setattr(baseline_losses, "distill_loss", spy)
    for variant, expected in (("authors", ("forward_kl", 2.0, True)), ("original", ("jsd", 1.1, False))):
        calls.clear()
        worker = make_worker(algorithm="opsd", opsd_variant=variant)
        opsd.client_round(worker, worker.loaded, arc_items[:2], lr=1e-2, seed=2, feedback=always_right)
        assert calls and set(calls) == {expected}


# ----------------------------------------------------------------------------------------------------------------------
# GRPO / RLTF-SD: the live forward and the old / reference log-probs share the dropout mode
# ----------------------------------------------------------------------------------------------------------------------


def first_step_ratios(algorithm, arc_items, monkeypatch, *, dropout: bool | None = None) -> torch.Tensor:
    """Per-token ratios exp(logp − old_logp) on the completion tokens of the first optimiser step's micro-batch
    (every ``grpo_loss`` call of it: one for GRPO, RL0 and RL1 for RLTF-SD), with ``lora_dropout = 0.1`` and a
    non-zero adapter (with B = 0 the LoRA path, and so its dropout, would contribute nothing). ``dropout`` forces
    ``TrainSettings.dropout`` (the control)."""
    module = grpo if algorithm == "grpo" else rltf_sd
    calls: list[torch.Tensor] = []
    real = baseline_losses.grpo_loss

    def spy(logp, old_logp, ref_logp, mask, advantages, eps, beta):
        if len(calls) < (1 if algorithm == "grpo" else 2):
            calls.append(torch.exp(logp.detach() - old_logp)[mask.bool()])
        return real(logp, old_logp, ref_logp, mask, advantages, eps, beta)

    monkeypatch.setattr(baseline_losses, "grpo_loss", spy)
    if dropout is not None:
        settings = module.settings
        monkeypatch.setattr(module, "settings", lambda cfg: dataclasses.replace(
            settings(cfg), train=dataclasses.replace(settings(cfg).train, dropout=dropout)))
    worker = make_worker(algorithm=algorithm, lora_dropout=0.1)
    assert any(m.p_eff > 0 for m in dropout_modules(worker.model) if hasattr(m, "p_eff"))
    nonzero_start(worker)
    module.client_round(worker, worker.loaded, arc_items[:2], lr=1e-2, seed=5, feedback=Alternate())
    return torch.cat(calls)


@pytest.mark.parametrize("algorithm", ["grpo", "rltf_sd"])
def test_first_step_ratio_is_one_with_lora_dropout(algorithm, arc_items, monkeypatch):
    """**Decision** (grpo.py / rltf_sd.py docstrings): the local steps run with dropout off, like the eval-mode
    old and reference log-probs, so at the first step (parameters unchanged) every per-token ratio is 1 to 1e-6.
    Control: forcing dropout on in the live forward moves the ratios well away from 1 (the defect this fixes)."""
    ratios = first_step_ratios(algorithm, arc_items, monkeypatch)
    assert ratios.numel() > 0
    assert float((ratios - 1).abs().max()) < 1e-6
    noisy = first_step_ratios(algorithm, arc_items, monkeypatch, dropout=True)
    assert float((noisy - 1).abs().max()) > 1e-3


def test_dropout_setting_per_algorithm_and_in_the_loop(tiny):
    """GRPO and RLTF-SD train without dropout; SPEAR, Feedback SFT and OPSD keep it (their path is unchanged).
    ``optimise`` leaves the model in train mode and puts only the dropout modules in eval mode."""
    from fedspear.runtime.model import LoraSettings, add_lora, tiny_model
    from fedspear.training import TrainSettings, optimise

    cfg = RunConfig().resolved()
    assert grpo.settings(cfg).train.dropout is False and rltf_sd.settings(cfg).train.dropout is False
    assert spear.settings(cfg).dropout is True and feedback_sft.settings(cfg).dropout is True
    assert opsd.settings(cfg).train.dropout is True

    model = add_lora(tiny_model(seed=0)[0], LoraSettings(r=2, alpha=4, dropout=0.1), seed=0)
    drops = dropout_modules(model)
    assert drops
    seen = {}

    def micro_step():
        seen["model"] = model.training
        seen["dropout"] = {m.training for m in drops}
        params = [p for p in model.parameters() if p.requires_grad]
        return {"loss": sum((p * 0).sum() for p in params)}

    for flag in (True, False):
        optimise(model, micro_step, TrainSettings(local_steps=1, dropout=flag), lr=1e-3, seed=0)
        assert seen == {"model": True, "dropout": {flag}}
