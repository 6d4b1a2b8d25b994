"""The train / held-out split (glmlight/split.py): every built-in task's held-out prompts never occur in its
training stream, whatever the seed; the overlap of an evaluation set with training is logged and warned about."""

import json
import logging

import pytest

from glmlight.run.build import build_sources
from glmlight.config.compose import compose
from glmlight.config.schema import EvalConfig, validate
from glmlight.config.rollout import RolloutConfig
from glmlight.data.chat_tasks import ChatQuestionTask
from glmlight.data.evaluation import EvalSet
from glmlight.data.rollout import RolloutDataModule
from glmlight.data.sources import ArithmeticTask, FileSource
from glmlight.engines.local.engine import LocalEngine
from glmlight.errors import ConfigError, DataError
from glmlight.rewards.verifiers import ExactMatch
from glmlight.split import Side, is_heldout, overlap, question_key, unit_hash

# Every built-in task and recipe whose prompts are synthetic, as a run composes it.
TASKS = [[], ["task=subtraction"], ["task=calculator_agent"], ["task=running_sum"], ["task=gateway_agent"],
         ["task=chat_arithmetic"], ["task=chat_sort"], ["task=chat_reverse"], ["task=chat_count_letter"],
         ["experiment=smollm2_grpo"], ["experiment=smollm2_sao"], ["experiment=smollm2_agent"],
         ["experiment=smollm2_compaction"], ["algo=compaction"]]


@pytest.mark.parametrize("overrides", TASKS, ids=lambda o: o[0] if o else "default")
def test_no_held_out_question_of_a_built_in_task_is_ever_trained_on(overrides):
    """The first 4,000 training prompts of seeds 0 and 1 (more than any recipe draws) and the held-out prompts
    of seeds 0, 1 and 2 share no question. Before the split, the default task's 64 held-out sums were all
    among its first 1,600 training prompts."""
    cfg = validate(compose(overrides))
    heldout = set()
    for seed in (0, 1, 2):
        _, held = build_sources(cfg.task, seed)
        heldout |= {question_key(held[i]) for i in range(max(cfg.task.num_eval_prompts, 64))}
    for seed in (0, 1):
        train, _ = build_sources(cfg.task, seed)
        trained = {question_key(train[i]) for i in range(4000)}
        assert not trained & heldout, sorted(trained & heldout)[:5]
        assert overlap(train, [held[i] for i in range(64)]) == 0.0


def test_the_split_depends_on_the_question_only_and_holds_out_about_its_fraction():
    assert unit_hash("3+4=") == unit_hash("3+4=") != unit_hash("4+3=")
    qs = [f"{a}+{b}=" for a in range(100) for b in range(100)]
    share = sum(is_heldout(q, 0.2) for q in qs) / len(qs)
    assert 0.18 < share < 0.22
    train, held = ArithmeticTask(seed=5), ArithmeticTask(seed=5, side=Side(True))
    assert all(train.contains(train[i]) and not train.contains(held[i]) for i in range(200))
    assert all(held.contains(held[i]) and not held.contains(train[i]) for i in range(200))
    # both sides are fixed by (seed, index)
    assert [held[i] for i in range(20)] == [ArithmeticTask(seed=5, side=Side(True))[i] for i in range(20)]


def test_a_space_too_small_to_split_stops_at_start_up():
    # max_operand=1: four sums; at a fraction of 1e-6 none of them is held out
    with pytest.raises(DataError, match="no held-out question in 10000 draws"):
        ArithmeticTask(max_operand=1, side=Side(True, 1e-6))
    with pytest.raises(ConfigError, match="config error: .*task.heldout_fraction=1e-06"):
        build_sources(validate(compose(["task.max_operand=1", "task.heldout_fraction=1e-6"])).task, 0)
    with pytest.raises(ConfigError, match=r"config error: task.heldout_fraction must be in \(0, 1\), got 1.5"):
        validate(compose(["task.heldout_fraction=1.5"]))
    with pytest.raises(DataError, match=r"must be in \(0, 1\)"):
        ChatQuestionTask("sort", side=Side(False, 0.0))


def test_overlap_of_files_and_synthetic_sources(tmp_path):
    def jsonl(name, questions):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"prompt": q, "label": "0"}) + "\n" for q in questions))
        return FileSource(str(path))

    train = jsonl("train.jsonl", ["1+2=", "3+4=", "5+6="])
    evalset = jsonl("eval.jsonl", ["3+4=", "7+8=", "9+9=", "1+2="])
    assert overlap(train, evalset.prompts) == 0.5
    synthetic = ArithmeticTask(seed=0)
    on_train_side = [q for q in ("1+2=", "3+4=", "7+8=", "9+9=") if not is_heldout(q, 0.2)]
    assert overlap(synthetic, evalset.prompts) == len(on_train_side) / 4
    assert overlap(synthetic, []) == 0.0


def test_the_run_logs_the_overlap_and_warns_once_when_a_set_is_not_held_out(tokenizer, tiny_model, tmp_path, caplog):
    train = ArithmeticTask(seed=0)
    path = tmp_path / "trained.jsonl"
    path.write_text("".join(json.dumps({"prompt": train[i].messages[0]["content"], "label": train[i].label}) + "\n"
                            for i in range(4)))
    rc = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, max_new_tokens=4)
    dm = RolloutDataModule(LocalEngine(tiny_model), tokenizer, train, ExactMatch(), rc,
                           eval_sets={"heldout": EvalSet(ArithmeticTask(seed=1, side=Side(True)), 4),
                                      "trained": FileSource(str(path))}, eval_cfg=EvalConfig(k=2, greedy=False))
    with caplog.at_level(logging.WARNING, logger="glmlight.data.rollout"):
        dm.setup("fit")
    warned = [r.getMessage() for r in caplog.records if "not held out" in r.getMessage()]
    assert warned == ["eval set 'trained' is not held out: 100.0% of its prompts can occur in training "
                      "(eval/trained/overlap); its figures partly measure trained-on prompts"]
    m = dm.evaluate()
    assert m["eval/heldout/overlap"] == 0.0 and m["eval/trained/overlap"] == 1.0
