"""Prompt sources and the RolloutDataModule's accounting (real engine, tiny model). The rewards and
verifiers: tests/unit/rewards/; the held-out evaluation: test_eval.py."""

import json
from collections import Counter

import pytest

from glmlight.config.rollout import RolloutConfig
from glmlight.groups import pad_or_drop_group, trajectories
from glmlight.data.evaluation import EvalSet
from glmlight.data.rollout import RolloutDataModule
from glmlight.data.shaping import apply_overlong
from glmlight.data.sources import ArithmeticTask, FileSource
from glmlight.errors import ConfigError, DataError
from glmlight.agents.loop import episode_to_samples
from glmlight.prompt import Prompt
from glmlight.engines.base import SamplingParams
from glmlight.engines.local.engine import LocalEngine
from glmlight.sample import Sample, Status


def test_jsonl_source_and_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "label": "2", "domain": "math", "extra": 3}) + "\n\n"
                    + json.dumps({"prompt": [{"role": "user", "content": "hi"}], "label": "x"}) + "\n")
    src = FileSource(str(path), system_prompt="be brief")
    assert len(src) == 2
    assert src[0].messages[0] == {"role": "system", "content": "be brief"}
    assert src[0].domain == "math" and src[1].domain == "default"
    assert src[0].metadata == {"label": "2", "domain": "math", "extra": 3}  # every field but the prompt
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: malformed JSON"):
        FileSource(str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"prompt": "  "}) + "\n")
    with pytest.raises(DataError, match=r"empty.jsonl:1: empty prompt"):
        FileSource(str(empty))
    with pytest.raises(ConfigError, match=r"m.jsonl: no field 'prompt' \(fields: question\); set task.prompt_key"):
        (tmp_path / "m.jsonl").write_text(json.dumps({"question": "x"}) + "\n")
        FileSource(str(tmp_path / "m.jsonl"))
    with pytest.raises(DataError, match="does not exist"):
        FileSource(str(tmp_path / "nope.jsonl"))


def test_hf_dataset_source(tmp_path):
    """A save_to_disk directory (every format and layout: test_data_files.py)."""
    datasets = pytest.importorskip("datasets")

    datasets.Dataset.from_list([{"prompt": "2+2=", "label": "4"}]).save_to_disk(str(tmp_path / "ds"))
    src = FileSource(str(tmp_path / "ds"))
    assert len(src) == 1 and src[0].label == "4"


def test_arithmetic_task_is_deterministic():
    a, b = ArithmeticTask(seed=3), ArithmeticTask(seed=3)
    assert [a[i] for i in range(5)] == [b[i] for i in range(5)]
    p = a[0]
    x, y = p.metadata["question"].rstrip("=").split("+")
    assert int(x) + int(y) == int(p.label)


def test_pad_or_drop_group_rule():
    g = [Sample(prompt_ids=[1], rollout_id=i) for i in range(4)]
    counts = Counter()
    # 3 of 4 valid (> half): padded back to 4 by repeating a valid one
    out = pad_or_drop_group(g, lambda t: t[0].rollout_id != 1, counts, "stale")
    assert len(out) == 4 and g[1] not in out and out[3] is g[0]
    assert counts == Counter({"dropped/stale": 1, "padded/stale": 1})
    # exactly half valid: dropped
    counts = Counter()
    assert pad_or_drop_group(g, lambda t: t[0].rollout_id < 2, counts, "stale") is None
    assert counts == Counter({"dropped/stale": 2, "dropped/group_stale": 2})


def test_segments_of_a_trajectory_stay_together():
    # two trajectories of two segments each, one invalid: the group keeps 1 of 2 -> dropped whole
    g = [Sample(prompt_ids=[1], rollout_id=r, segment=s) for r in (0, 1) for s in (1, 0)]
    assert [[(x.rollout_id, x.segment) for x in t] for t in trajectories(g)] == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]
    counts = Counter()
    assert pad_or_drop_group(g, lambda t: t[0].rollout_id == 0, counts, "stale") is None
    assert counts == Counter({"dropped/stale": 2, "dropped/group_stale": 2})


def _datamodule(tokenizer, model, reward, **cfg):
    rc = RolloutConfig(**{"rollout_batch_size": 4, "n_samples_per_prompt": 4, "max_new_tokens": 4, **cfg})
    return RolloutDataModule(LocalEngine(model), tokenizer, ArithmeticTask(seed=0), reward, rc,
                             eval_sets={"heldout": EvalSet(ArithmeticTask(seed=1), 4)})


def test_datamodule_batch_and_accounting(tokenizer, tiny_model):
    calls = []

    def reward(sample):
        calls.append(sample.rollout_id)
        if sample.rollout_id == 1:
            raise ValueError("broken")
        return float(sample.rollout_id % 2)

    dm = _datamodule(tokenizer, tiny_model, reward)
    exp = dm.next_experience()
    # group 0 lost one sample (reward crash) and was padded back: 16 rows, 15 distinct samples
    assert exp.batch_size == 16
    assert dm.totals["produced"] == 16 and dm.totals["trained"] == 15 and dm.totals["dropped/failed"] == 1
    assert exp.stats["rollout/produced"] == 16.0
    assert all(s.metadata["completion_text"] == tokenizer.decode(s.response_ids, skip_special_tokens=True)
               for s in exp.samples)
    assert exp.loss_mask.sum() == exp.response_mask.sum()


def test_dynamic_sampling_refills_and_counts(tokenizer, tiny_model):
    # reward depends only on the group: groups with even id are all-zero (dropped), odd groups mixed
    def reward(sample):
        return float(sample.group_id % 2 == 1 and sample.rollout_id % 2 == 0)

    dm = _datamodule(tokenizer, tiny_model, reward, dynamic_sampling=True, max_refill_rounds=8)
    exp = dm.next_experience()
    assert len({s.group_id for s in exp.samples}) == 4
    assert all(s.group_id % 2 == 1 for s in exp.samples)
    t = dm.totals
    assert t["produced"] == t["trained"] + sum(v for k, v in t.items() if k.startswith("dropped/"))
    assert t["dropped/zero_variance_group"] >= 16


def test_dynamic_sampling_filters_on_the_outcome_not_on_the_length_penalty(tokenizer, tiny_model):
    # Every answer is wrong (reward 0) but lengths differ, so the soft overlong penalty gives the
    # group different rewards: DAPO keeps a group only when 0 < #correct < G, so it is dropped.
    dm = _datamodule(tokenizer, tiny_model, lambda s: 0.0, dynamic_sampling=True, max_refill_rounds=0,
                     overlong="soft_penalty", overlong_cache=4, max_new_tokens=6)
    counts = Counter()
    samples = dm.rollout(dm.draw_prompts(4), 4, counts)
    for i, s in enumerate(samples):  # make the lengths (and so the penalties) differ inside each group
        s.reward = -0.25 * (i % 4)
        s.metadata["overlong_penalty"] = s.reward
    assert any(len({s.reward for s in samples if s.group_id == g}) > 1 for g in {s.group_id for s in samples})
    assert dm._filter_groups(samples, counts) == []
    assert counts["dropped/zero_variance_group"] == 16


def test_soft_overlong_penalty_counts_the_turn_the_budget_limits(tokenizer, tiny_model):
    # A 3-turn episode: each action turn is short (3 tokens, budget max_new_tokens = 8, cache 4: no
    # penalty below 4 tokens), but with observations the whole response is far longer than 8.
    from glmlight.agents import AgentLoop

    env_factory = lambda: ScriptedEnv(turns=3)  # noqa: E731
    engine = _ThreeTokenEngine(tokenizer)
    loop = AgentLoop(engine, tokenizer, env_factory, lambda ctx: SamplingParams(max_new_tokens=8), max_turns=3)
    ep = loop.run([Prompt(messages=[{"role": "user", "content": "go"}], label="x")])[0]
    assert ep.turns == 3 and ep.action_lengths == [3, 3, 3]
    (sample,) = episode_to_samples(ep, group_id=0, rollout_id=0)
    assert sample.response_length > 8
    dm = _datamodule(tokenizer, tiny_model, lambda s: 1.0, overlong="soft_penalty", overlong_cache=4, max_new_tokens=8)
    apply_overlong([sample], dm.cfg.overlong, dm.cfg.max_new_tokens, dm.cfg.overlong_cache, Counter())
    assert sample.reward == 1.0 and sample.metadata["overlong_penalty"] == 0.0
    # a turn that runs into the cache window is penalised: (8 - 4 - 7) / 4 = -0.75
    long = episode_to_samples(ep, group_id=0, rollout_id=1)[0]
    long.metadata["action_lengths"] = [3, 7, 3]
    apply_overlong([long], dm.cfg.overlong, dm.cfg.max_new_tokens, dm.cfg.overlong_cache, Counter())
    assert long.metadata["overlong_penalty"] == -0.75


class ScriptedEnv:
    def __init__(self, turns=3):
        self.turns, self.t = turns, 0

    def reset(self, prompt):
        return list(prompt.messages)

    def step(self, action):
        from glmlight.agents import StepResult

        self.t += 1
        if self.t >= self.turns:
            return StepResult(None, reward=1.0, done=True)
        return StepResult(f"observation number {self.t} with some words")


class _ThreeTokenEngine:
    """Answers every turn with the same three tokens (a stand-in policy for the loop)."""

    version = 0

    def __init__(self, tokenizer):
        self.ids = tokenizer("ab", add_special_tokens=False)["input_ids"][:2] + [tokenizer.eos_token_id]

    def generate(self, prompts, params):
        from glmlight.engines.base import Generation

        return [Generation(list(self.ids), [-0.1] * 3, "stop", [0] * 3) for _ in prompts]


def test_overlong_mask_and_prompt_too_long(tokenizer, tiny_model):
    dm = _datamodule(tokenizer, tiny_model, lambda s: float(s.rollout_id % 2), overlong="mask")
    exp = dm.next_experience()
    truncated = [i for i, s in enumerate(exp.samples) if s.status is Status.TRUNCATED]
    assert truncated and all(exp.loss_mask[i].sum() == 0 for i in truncated)
    dm = _datamodule(tokenizer, tiny_model, lambda s: 1.0, max_context=5)
    counts = Counter()
    assert dm.rollout(dm.draw_prompts(2), 2, counts) == []
    assert counts["dropped/prompt_too_long"] == 4


def test_aborted_groups_are_dropped_counted_and_their_prompts_generated_again(tokenizer, tiny_model):
    dm = _datamodule(tokenizer, tiny_model, lambda s: float(s.rollout_id % 2))
    counts = Counter()
    prompts = dm.draw_prompts(2)
    samples = dm.rollout(prompts, 2, counts)
    for s in samples[:2]:  # the first group's generation was aborted by a weight update
        s.status = Status.ABORTED
    groups = dm._filter_groups(samples, counts)
    assert len(groups) == 1 and counts["dropped/aborted"] == 2
    again = dm.draw_prompts(2)
    assert again[0].metadata["prompt_index"] == prompts[0].metadata["prompt_index"]
    assert again[1].metadata["prompt_index"] not in {p.metadata["prompt_index"] for p in prompts}
