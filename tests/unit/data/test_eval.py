"""Held-out evaluation: pass@k and majority vote by hand, the evaluation of a real run (k samples,
greedy, several named sets, cost), its seed stream kept apart from training's."""

import json
import math
import os
import random
from fractions import Fraction

import pytest
import torch

import glmlight
from glmlight import compose
from glmlight.config.schema import EvalConfig
from glmlight.config.rollout import RolloutConfig
from glmlight.data.evaluation import EvalSet, SeededEngine
from glmlight.data.rollout import RolloutDataModule
from glmlight.data.sources import ArithmeticTask
from glmlight.ops.eval_metrics import maj_at_k, majority_vote, mean_pass_at_k, pass_at_k, pass_k_values
from glmlight.rewards.verifiers import ExactMatch
from glmlight.engines.base import SamplingParams
from glmlight.engines.local.engine import LocalEngine
from tests.conftest import overrides_for_tests
from tests.unit.data.test_data import _datamodule


# ----------------------------------------------------------------- the estimators, by hand
def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # c / n
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(10, 3, 5) == pytest.approx(11 / 12)  # 1 - C(7,5)/C(10,5) = 1 - 21/252
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(3, 2, 2) == 1.0  # n - c < k: every pair holds a correct answer
    assert pass_at_k(8, 8, 8) == 1.0 and pass_at_k(8, 1, 8) == 1.0 and pass_at_k(8, 0, 8) == 0.0


def test_pass_at_k_is_stable_where_the_binomials_overflow():
    # C(999, 500) / C(1000, 500) = 500 / 1000, though C(1000, 500) ~ 2.7e299 and float factorials overflow
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5, abs=1e-12)
    exact = 1 - Fraction(math.comb(1990, 100), math.comb(2000, 100))
    assert pass_at_k(2000, 10, 100) == pytest.approx(float(exact), rel=1e-12)


def test_mean_pass_at_k_and_its_errors():
    # prompts with 0, 1 and 4 correct of 4: pass@2 = (0 + (1 - C(3,2)/C(4,2)) + 1) / 3 = (0 + 0.5 + 1) / 3
    assert mean_pass_at_k([0, 1, 4], 4, 2) == pytest.approx(0.5)
    assert mean_pass_at_k([0, 1, 4], 4, 1) == pytest.approx((0 + 0.25 + 1) / 3)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    assert pass_k_values(8) == [1, 2, 4, 8] and pass_k_values(6) == [1, 2, 4, 6] and pass_k_values(1) == [1]


def test_majority_vote_by_hand():
    assert majority_vote(["3", "4", "3", None, "4", "4"]) == 1  # "4" has three votes; its first carrier
    assert majority_vote(["a", "b", "b", "a"]) == 0  # a tie goes to the answer seen first
    assert majority_vote([None, None]) is None
    assert maj_at_k(["3", "4", "4"], [True, False, False]) == 0.0  # the majority is wrong
    assert maj_at_k(["3", None, "3", "5"], [True, False, True, False]) == 1.0
    assert maj_at_k([None, None], [False, False]) == 0.0


# ----------------------------------------------------------------- the evaluation itself
def _dm(tokenizer, model, eval_cfg, sets=None):
    rc = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, max_new_tokens=4)
    return RolloutDataModule(LocalEngine(model), tokenizer, ArithmeticTask(seed=0), ExactMatch(), rc,
                             eval_sets={"heldout": EvalSet(ArithmeticTask(seed=1), 4), **(sets or {})},
                             eval_cfg=eval_cfg)


def test_evaluation_is_fixed_and_touches_no_training_stream(tokenizer, tiny_model):
    dm = _dm(tokenizer, tiny_model, EvalConfig(k=4))
    engine_state = dm.engine.state_dict()["generator"].clone()
    stream = dm.stream.state_dict()
    torch_state, py_state = torch.get_rng_state(), random.getstate()
    a = dm.evaluate()
    b = dm.evaluate()
    assert {k: v for k, v in a.items() if not k.endswith("seconds")} == \
        {k: v for k, v in b.items() if not k.endswith("seconds")}
    assert torch.equal(dm.engine.state_dict()["generator"], engine_state)  # no seed drawn from the engine
    assert dm.stream.state_dict() == stream  # no group or rollout ids taken
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == py_state
    for key in ("pass@1", "pass@2", "pass@4", "maj@4", "reward", "response_length", "greedy/pass_rate",
                "greedy/reward", "tokens", "seconds", "prompts"):
        assert f"eval/heldout/{key}" in a, key
    assert a["eval/heldout/prompts"] == 4.0
    assert 0.0 <= a["eval/heldout/pass@1"] <= a["eval/heldout/pass@2"] <= a["eval/heldout/pass@4"] <= 1.0
    assert a["eval/tokens"] == a["eval/heldout/tokens"] > 0


def test_evaluate_is_fixed(tokenizer, tiny_model):
    dm = _datamodule(tokenizer, tiny_model, ExactMatch())
    a, b = dm.evaluate(), dm.evaluate()
    a = {k: v for k, v in a.items() if not k.endswith("seconds")}
    b = {k: v for k, v in b.items() if not k.endswith("seconds")}
    assert a == b and set(a) >= {"eval/heldout/greedy/pass_rate", "eval/heldout/pass@1", "eval/heldout/response_length"}


def test_seeded_engine_gives_every_request_its_own_seed(tokenizer, tiny_model):
    engine = LocalEngine(tiny_model)
    seen = []

    class Recording:
        def generate(self, prompts, params):
            seen.append([p.seed for p in params])
            return engine.generate(prompts, params)

    e1, e2 = SeededEngine(Recording(), "heldout", 7), SeededEngine(Recording(), "heldout", 7)
    p = [[1, 2, 3]] * 3
    out1 = e1.generate(p, [SamplingParams(max_new_tokens=3)] * 3)
    out2 = e2.generate(p, [SamplingParams(max_new_tokens=3)] * 3)
    assert seen[0] == seen[1] and len(set(seen[0])) == 3  # same seeds each evaluation, one per request
    assert [g.token_ids for g in out1] == [g.token_ids for g in out2]
    e1.generate(p[:1], [SamplingParams(max_new_tokens=3, seed=5)])
    assert seen[2] == [5]  # a request that has a seed keeps it
    SeededEngine(Recording(), "other", 7).generate(p, [SamplingParams(max_new_tokens=3)] * 3)
    assert not set(seen[3]) & set(seen[0])  # another set, other seeds


def test_named_sets_are_evaluated_and_reported_under_their_names(tokenizer, tiny_model, tmp_path):
    path = tmp_path / "extra.jsonl"
    rows = [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a, b in [(1, 2), (3, 4), (2, 2)]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from glmlight.data.sources import FileSource

    dm = _dm(tokenizer, tiny_model, EvalConfig(k=2, greedy=False), sets={"extra": FileSource(str(path))})
    m = dm.evaluate()
    assert m["eval/extra/prompts"] == 3.0 and m["eval/heldout/prompts"] == 4.0
    assert "eval/extra/pass@2" in m and "eval/extra/greedy/pass_rate" not in m
    assert m["eval/tokens"] == m["eval/heldout/tokens"] + m["eval/extra/tokens"]


def test_eval_config_keys_and_errors(tmp_path):
    from glmlight.config.schema import validate
    from glmlight.errors import ConfigError

    cfg = validate(compose(["eval.k=4", "eval.every_n_steps=5", "+eval.sets.gsm.path=/data/gsm.jsonl"]))
    assert cfg.eval.k == 4 and cfg.eval.every_n_steps == 5 and cfg.eval.sets.gsm.path == "/data/gsm.jsonl"
    with pytest.raises(ConfigError, match="unknown key 'eval.sets.gsm.pth'; did you mean 'path'"):
        validate(compose(["+eval.sets.gsm.pth=/data/gsm.jsonl"]))
    with pytest.raises(ConfigError, match="eval.k must be >= 0"):
        validate(compose(["eval.k=-1"]))
    with pytest.raises(ConfigError, match="eval.sets.heldout"):
        glmlight.build(compose(overrides_for_tests(tmp_path, "+eval.sets.heldout.path=x.jsonl")))
    with pytest.raises(ConfigError, match="does not exist"):
        glmlight.build(compose(overrides_for_tests(tmp_path, f"+eval.sets.gsm.path={tmp_path}/missing.jsonl")))


def test_default_run_logs_the_evaluation(tmp_path):
    """The default task end to end: evaluation at the start and every eval.every_n_steps, k samples and
    greedy, the cost logged, the console line, rl_step on every row of metrics.jsonl."""
    run = glmlight.build(compose(overrides_for_tests(tmp_path, "trainer.max_steps=2", "eval.every_n_steps=2",
                                                     "eval.k=4")))
    run.fit()
    rows = [json.loads(line) for line in open(os.path.join(str(tmp_path), "metrics.jsonl"))]
    evals = [r for r in rows if "eval/heldout/pass@1" in r]
    assert [r["rl_step"] for r in evals] == [0, 2]
    for r in evals:
        assert r["eval/heldout/pass@1"] <= r["eval/heldout/pass@4"]
        assert r["eval/seconds"] > 0 and r["eval/tokens"] > 0 and r["eval/heldout/prompts"] == 8
    [cb] = [c for c in run.trainer.callbacks if type(c).__name__ == "HeldOutEval"]
    assert [step for step, _ in cb.history] == [0, 2]


def test_evaluate_script_shows_the_prompt_of_a_jsonl_task(tmp_path, capsys):
    """scripts/evaluate.py --show N prints each shown answer with its prompt (the question), label and reward."""
    import json

    from tests.conftest import load_script, overrides_for_tests

    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "label": str(i + 1)}) + "\n" for i in range(4)))
    script = load_script("evaluate")
    overrides = overrides_for_tests(tmp_path, "task=jsonl", f"task.path={path}", f"task.eval_path={path}",
                                    "task.num_eval_prompts=2", "eval.k=1")
    assert script.main(overrides + ["--show", "2"]) == 0
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(shown) == 2, shown
    for row in shown:
        assert row["prompt"] is not None, row
        assert row["question"].startswith("What is ") and row["prompt"] == [{"role": "user", "content": row["question"]}]
        assert row["label"] == str(int(row["question"].split()[2]) + 1)
