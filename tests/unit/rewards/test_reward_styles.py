"""TRL- and verl-style reward functions as they are (glmlight/rewards/styles.py): the calling conventions,
the start-up check against the data's columns, one logged traceback for a failing reward, and the reward examples
of docs/configuration.md's "Bring your own reward" (examples/byo/rewards.py) scoring right and wrong answers."""

import logging
import types
from pathlib import Path

import pytest

from glmlight.config.rollout import RewardOptions
from glmlight.errors import ConfigError
from glmlight.prompt import Prompt
from glmlight.rewards import build_reward, task_reward
from glmlight.rewards.base import score_samples
from glmlight.rewards.styles import TrlReward, VerlReward, check_reward_data, detect_style
from glmlight.sample import Sample

ROOT = Path(__file__).resolve().parents[3]
seen: list = []


def _s(text, label, group=0, rid=0, **meta):
    return Sample(prompt_ids=[1], response_ids=[5, 6], loss_mask=[1, 1], rollout_logprobs=[0.0, 0.0], versions=[0, 0],
                  group_id=group, rollout_id=rid,
                  metadata={"completion_text": text, "label": label, "domain": "math", **meta})


# Module-level so that worker processes can import them (executor=process).
def trl_accuracy(prompts, completions, completion_ids, solution, trainer_state=None, **kwargs):
    seen.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                 "solution": solution, "trainer_state": trainer_state, **kwargs})
    return [None if s is None else float(c[0]["content"].strip() == s) for c, s in zip(completions, solution)]


def trl_record(prompts, completions, **kwargs):
    seen.append({"prompts": prompts, "completions": completions})
    return [1.0] * len(completions)


def trl_strict(completions, solution):  # no **kwargs: only what it names is passed
    return [float(c[0]["content"] == s) for c, s in zip(completions, solution)]


def trl_raises(completions, **kwargs):
    raise KeyError("boom")


def verl_score(data_source, solution_str, ground_truth, extra_info=None):
    seen.append((data_source, solution_str, ground_truth, extra_info))
    return {"score": float(solution_str.strip() == ground_truth), "acc": solution_str.strip() == ground_truth}


def sample_raises(sample):
    raise ValueError(f"bad sample {sample.rollout_id}")


def test_the_style_comes_from_the_signature():
    assert detect_style(trl_accuracy) == "trl" and detect_style(trl_strict) == "trl"
    assert detect_style(verl_score) == "verl"
    assert detect_style(sample_raises) == "sample"
    assert isinstance(build_reward({"_target_": f"{__name__}.trl_accuracy"}), TrlReward)
    assert isinstance(build_reward({"_target_": f"{__name__}.verl_score"}), VerlReward)


def test_a_trl_reward_gets_trls_arguments_once_per_group():
    seen.clear()
    fn = build_reward({"_target_": f"{__name__}.trl_accuracy"}, label_key="solution")
    samples = [_s("4", "4", 0, 0, question="2+2"), _s("5", "4", 0, 1, question="2+2"),
               _s("9", "9", 1, 2, question="3+6"), _s("1", None, 2, 3, question="?")]
    counts = score_samples(fn, samples)
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, None]
    assert counts["scored"] == 3 and counts["failed"] == 1
    assert "returned None" in samples[3].metadata["reward_error"]
    assert sorted(len(c["completions"]) for c in seen) == [1, 1, 2]  # one call per prompt group
    call = next(c for c in seen if len(c["completions"]) == 2)
    assert call["completions"] == [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]]
    assert call["solution"] == ["4", "4"] and call["label"] == ["4", "4"] and call["question"] == ["2+2", "2+2"]
    assert call["completion_ids"] == [[5, 6], [5, 6]] and call["trainer_state"] is None
    assert call["domain"] == ["math", "math"] and callable(call["log_extra"]) and callable(call["log_metric"])
    assert "completion_text" not in call and "prompt_index" not in call


def test_a_trl_reward_with_a_plain_string_prompt_gets_strings():
    seen.clear()
    fn = build_reward({"_target_": f"{__name__}.trl_record"}, style="trl")
    fn.score_batch([_s("4", "4", prompt_messages="2+2=")])
    assert seen[0]["completions"] == ["4"] and seen[0]["prompts"] == ["2+2="]


def test_a_trl_reward_without_kwargs_and_under_the_process_executor():
    fn = build_reward({"_target_": f"{__name__}.trl_strict"}, label_key="solution")
    samples = [_s("4", "4", 0, 0), _s("5", "4", 0, 1), _s("7", "7", 1, 2)]
    counts = score_samples(fn, samples, {"executor": "process", "max_concurrency": 2})
    assert counts["scored"] == 3 and [s.reward for s in samples] == [1.0, 0.0, 1.0]


def test_a_verl_reward_gets_verls_arguments():
    seen.clear()
    fn = build_reward({"_target_": f"{__name__}.verl_score"})
    samples = [_s(" 18", "18", data_source="openai/gsm8k", extra_info={"index": 3}), _s("17", "18", rid=1)]
    counts = score_samples(fn, samples)
    assert counts["scored"] == 2 and [s.reward for s in samples] == [1.0, 0.0]
    assert samples[0].metadata["reward_info"] == {"acc": True}
    assert sorted(seen, key=str)[0] == ("math", "17", "18", {})
    assert ("openai/gsm8k", " 18", "18", {"index": 3}) in seen


def test_the_data_is_checked_at_start_up():
    trl = build_reward({"_target_": f"{__name__}.trl_accuracy"})
    with pytest.raises(ConfigError) as e:
        check_reward_data(trl, "4", "math", {"question": "2+2"}, "label")
    assert str(e.value) == (f"config error: task.reward ({__name__}.trl_accuracy) asks for the column 'solution', "
                            "which the data does not have (columns: ['domain', 'label', 'question']); set "
                            "task.label_key=solution if it is the data's label column")
    check_reward_data(trl, "4", "math", {"solution": "4"}, "label")  # the column is there
    check_reward_data(build_reward({"_target_": f"{__name__}.trl_accuracy"}, label_key="solution"), "4", "math", {},
                      "solution")  # it is the label
    with pytest.raises(ConfigError, match="is verl-style and scores against ground_truth, the label"):
        check_reward_data(build_reward({"_target_": f"{__name__}.verl_score"}), None, "math", {"answer": "4"}, "label")


def test_task_reward_checks_the_first_prompt():
    task = types.SimpleNamespace(reward={"_target_": f"{__name__}.trl_accuracy"}, label_key="label",
                                 reward_options=RewardOptions())
    with pytest.raises(ConfigError, match="asks for the column 'solution'"):
        task_reward(task, [Prompt(messages=[{"role": "user", "content": "2+2"}], label="4")])
    task.label_key = "solution"
    task_reward(task, [Prompt(messages=[{"role": "user", "content": "2+2"}], label="4")]).close()


def test_style_is_a_checked_reward_option():
    with pytest.raises(ConfigError, match=r"task.reward_options.style='tlr' is not one of"):
        score_samples(lambda s: 1.0, [_s("1", "1")], {"style": "tlr"})
    with pytest.raises(ConfigError, match="calling convention"):
        build_reward({"_target_": f"{__name__}.trl_strict", "style": "trl"})
    with pytest.raises(ConfigError, match="takes no `completions` argument"):
        build_reward({"_target_": f"{__name__}.sample_raises"}, style="trl")


@pytest.mark.parametrize("target, options", [("sample_raises", {}), ("sample_raises", {"executor": "process"}),
                                             ("trl_raises", {})])
def test_a_failing_reward_logs_its_traceback_once_and_counts_the_rest(caplog, target, options):
    fn = build_reward({"_target_": f"{__name__}.{target}"})
    samples = [_s("1", "1", group=i // 4, rid=i) for i in range(16)]
    with caplog.at_level(logging.WARNING, logger="glmlight.rewards.base"):
        counts = score_samples(fn, samples, {"max_concurrency": 2, **options})
    assert counts["failed"] == 16
    records = [r for r in caplog.records if r.name == "glmlight.rewards.base"]
    assert len(records) == 1, [r.getMessage() for r in records]
    message = records[0].getMessage()
    assert "Traceback" in message and target in message and "rollout/reward_failed" in message
    assert all(s.metadata["reward_error"].startswith(("ValueError: bad sample", "KeyError: 'boom'")) for s in samples)


# --------------------------------------------------------------------------- the documented examples, as written
def test_the_documented_reward_examples_score_as_they_should(monkeypatch):
    """Each reward docs/configuration.md's "Bring your own reward" runs (examples/byo/rewards.py, whose code the doc
    shows: tests/integration/test_docs_byo.py), with that command's label key, on right and wrong answers."""
    monkeypatch.syspath_prepend(str(ROOT))
    section = (ROOT / "docs/configuration.md").read_text().split("## Bring your own reward", 1)[1].split("\n## ", 1)[0]
    commands = [line for line in section.splitlines() if "task.reward._target_=examples.byo.rewards." in line]
    assert len(commands) == 3
    for line in commands:
        overrides = dict(x.split("=", 1) for x in line.split() if "=" in x and not x.startswith('"'))
        label_key = overrides.get("task.label_key", "label")
        fn = build_reward({"_target_": overrides["task.reward._target_"]}, label_key=label_key)
        samples = [_s("42", "42", 0, 0, data_source="gsm8k"), _s("41", "42", 0, 1), _s("7", "7", 1, 2)]
        counts = score_samples(fn, samples)
        assert counts["scored"] == 3, (line, [s.metadata.get("reward_error") for s in samples])
        assert [s.reward for s in samples] == [1.0, 0.0, 1.0], line
        check_reward_data(fn, "42", "math", {}, label_key)


@pytest.mark.parametrize("prompt", ["What is 2+2?", [{"role": "user", "content": "What is 2+2?"}]],
                         ids=["standard", "conversational"])
def test_a_trl_reward_in_a_run_gets_the_datas_prompts_as_they_are(tmp_path, prompt):
    """Through a real run (task=jsonl, one RL step): TRL's `prompts` are the data's prompt column as it is, and
    the completions strings for a plain prompt, message lists for a conversational one (TRL's GRPOTrainer)."""
    import json

    import glmlight
    from glmlight import compose
    from tests.conftest import overrides_for_tests

    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "solution": "4"}) + "\n")
    seen.clear()
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "task=jsonl", f"task.path={path}", "task.label_key=solution", "model.warm_start.steps=0",
        "task.reward._target_=tests.unit.rewards.test_reward_styles.trl_record", "trainer.max_steps=1",
        "eval.every_n_steps=0")))
    run.fit()
    assert seen and all(p == prompt for call in seen for p in call["prompts"])
    completions = [c for call in seen for c in call["completions"]]
    assert all(isinstance(c, str) for c in completions) if isinstance(prompt, str) else \
        all(isinstance(c, list) and c[0]["role"] == "assistant" for c in completions)
