"""The run report (report.png, summary.json from metrics.jsonl) for every algorithm, and sample
inspection (the samples table, scripts/samples.py)."""

import csv
import glob
import json
import math
import os

import pytest

import glmlight
from glmlight import compose
from glmlight.run.report import read_metrics, summarize, write_report
from tests.conftest import load_script, overrides_for_tests

ALGOS = {
    "grpo": [],
    "sao": ["algo=sao", "rollout.mode=sync", "algo.critic_warmup_steps=0"],
    "opd": ["algo=opd", "rollout.n_samples_per_prompt=1", "algo.teachers.tiny150.preset=test",
            "algo.teachers.tiny150.warm_start.steps=2", "algo.teachers.tiny150.warm_start.batch_size=8"],
    "compaction": ["algo=compaction", "rollout.mode=sync", "rollout.rollout_batch_size=2", "algo.critic_warmup_steps=0",
                   "task.num_eval_prompts=2"],  # (long episodes; slow)
}


def _csv_last_values(root):
    last = {}
    for path in glob.glob(os.path.join(str(root), "csv", "*", "metrics.csv")):
        for r in csv.DictReader(open(path)):
            for k, v in r.items():
                if v not in ("", None) and k != "step":
                    last[k] = float(v)
    return last


@pytest.mark.parametrize("algo", [pytest.param(a, marks=pytest.mark.slow) if a in ("compaction", "sao") else a
                                  for a in sorted(ALGOS)])
def test_every_run_ends_with_its_report_and_the_summary_equals_the_logged_metrics(tmp_path, algo):
    extra = [f"algo.teachers.tiny150.warm_start.cache_dir={tmp_path}/cache"] if algo == "opd" else []
    run = glmlight.build(compose(overrides_for_tests(tmp_path, *ALGOS[algo], *extra, "trainer.max_steps=2",
                                                     "logger.report=true", "eval.k=2", "eval.every_n_steps=2")))
    run.fit()
    png, js = os.path.join(str(tmp_path), "report.png"), os.path.join(str(tmp_path), "summary.json")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 20_000
    summary = json.load(open(js))
    assert summary["rl_steps"] == 2 and summary["skipped_lines"] == 0
    logged = _csv_last_values(tmp_path)  # what the CSV logger received, independently of metrics.jsonl
    for key in ("rollout/reward_mean", "train/entropy", "rollout/response_length", "rollout/seconds",
                "train/seconds", "eval/heldout/pass@1", "eval/heldout/pass@2", "eval/seconds"):
        assert key in summary["metrics"], key
    for key, value in logged.items():
        if key == "rl_step" or math.isnan(value):  # non-finite values are null in metrics.jsonl, left out
            continue
        assert summary["metrics"][key]["last"] == value, key
    assert summary["metrics"]["eval/heldout/pass@1"]["first_rl_step"] == 0
    assert summary["totals"]["train_seconds"] == pytest.approx(
        sum(r["train/seconds"] for r in read_metrics(str(tmp_path))[0].values() if "train/seconds" in r))


def test_report_reads_a_killed_run_and_later_lines_win(tmp_path):
    rows = [{"step": 0, "rl_step": 1, "rollout/reward_mean": 0.1}, {"step": 1, "rl_step": 2, "rollout/reward_mean": 0.2},
            {"step": 1, "rl_step": 2, "rollout/reward_mean": 0.3}]  # a resumed run logged step 2 again
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2, "rl_st')  # cut short by a kill
    got, skipped = read_metrics(str(tmp_path))
    assert skipped == 1 and got == {1: {"rollout/reward_mean": 0.1}, 2: {"rollout/reward_mean": 0.3}}
    s = summarize(got, skipped)["metrics"]["rollout/reward_mean"]
    assert (s["first"], s["last"], s["min"], s["max"], s["last_rl_step"]) == (0.1, 0.3, 0.1, 0.3, 2)
    assert set(write_report(str(tmp_path))) == {"summary", "report"}
    script = load_script("report")
    assert script.main([str(tmp_path), "--print"]) == 0
    assert script.main([str(tmp_path / "nowhere")]) == 2


def test_two_runs_side_by_side(tmp_path, capsys):
    for name, values in (("a", [0.1, 0.5]), ("b", [0.2, 0.4])):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            f.write("".join(json.dumps({"rl_step": 5 * i, "eval/heldout/pass@1": v}) + "\n" for i, v in enumerate(values)))
    script = load_script("report")
    out = tmp_path / "ab.png"
    args = [str(tmp_path / "a"), "--compare", str(tmp_path / "b"), "--out", str(out), "--keys", "eval/heldout/pass@1"]
    assert script.main(args) == 0 and out.stat().st_size > 1000
    assert script.main(args[:-1] + ["eval/nothing"]) == 2  # no run logged it: one line, named
    assert "no run in" in capsys.readouterr().err
    assert script.main(args + ["--labels", "only-one"]) == 2


def test_samples_table_and_the_samples_command(tmp_path, capsys):
    """Trained rows carry reward info, versions and the corrections' token counts; dynamic sampling drops
    the zero-variance groups, which appear with their drop reason."""
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "trainer.max_steps=2", "~callbacks.held_out_eval", "callbacks.sample_table.every_n_steps=1",
        "rollout.dynamic_sampling=true", "task.reward._target_=tests.conftest.equal_on_even_prompts_reward",
        "+callbacks.icepop._target_=glmlight.callbacks.IcePop", "+callbacks.icepop.keep_in_denominator=false",
        "+callbacks.icepop.low=0.999", "+callbacks.icepop.high=1.001",  # a narrow band: tokens are removed
        "rollout.dtype=bfloat16")))
    run.fit()
    rows = [json.loads(line) for line in open(os.path.join(str(tmp_path), "samples.jsonl"))]
    trained = [r for r in rows if not r["drop_reason"]]
    dropped = [r for r in rows if r["drop_reason"]]
    assert {r["rl_step"] for r in trained} == {1, 2}
    assert dropped and {r["drop_reason"] for r in dropped} == {"zero_variance_group"}
    assert all(r["masked_tokens"] is None for r in dropped)
    for r in trained:
        assert r["prompt"] and isinstance(r["reward"], float) and r["status"] in ("completed", "truncated")
        assert 0 <= r["masked_tokens"] <= r["action_tokens"] and r["zero_weight_tokens"] == 0
        assert r["versions"] == [r["policy_version"] - 1] or r["versions"] == []  # produced by the synced weights
    assert any(r["masked_tokens"] > 0 for r in trained)  # bf16 engine vs fp32 trainer: IcePop removes tokens

    script = load_script("samples")
    capsys.readouterr()
    assert script.main([str(tmp_path), "--worst", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"3 of {len(rows)} rows") and out.count("completion:") == 3
    lowest = min(r["reward"] for r in trained)
    assert f"reward {lowest}" in out.splitlines()[1]
    assert script.main([str(tmp_path), "--dropped", "2"]) == 0
    assert capsys.readouterr().out.count("DROPPED: zero_variance_group") == 2
    assert script.main([str(tmp_path), "--masked", "1"]) == 0
    most = max(r["masked_tokens"] for r in trained)
    assert f"{most} masked" in capsys.readouterr().out


def test_sample_rows_carry_the_label_and_the_question_and_the_samples_command_shows_them(tokenizer):
    """A row holds the label the reward compared with and the prompt's question (its last user message);
    scripts/samples.py shows both by default, also behind a long system message."""
    from types import SimpleNamespace

    from glmlight.callbacks import SampleTable
    from glmlight.models.tokenizer import encode_chat
    from glmlight.prompt import Prompt
    from glmlight.sample import Sample

    system = "You are a careful assistant who shows the work and boxes the final answer. " * 4
    prompt = Prompt(messages=[{"role": "system", "content": system}, {"role": "user", "content": "What is 17 + 25?"}],
                    label="42")
    ids, answer = encode_chat(tokenizer, prompt.messages), encode_chat(tokenizer, [{"role": "user", "content": "41"}])
    s = Sample(prompt_ids=ids, response_ids=answer[:3], loss_mask=[1] * 3, rollout_logprobs=[0.0] * 3,
               versions=[0] * 3, reward=0.0,
               metadata={"label": "42", "prompt_index": 0, "reward_info": {"pred": "41"}})
    row = SampleTable().row(tokenizer, SimpleNamespace(rl_step=1, policy_version=1), s, source=[prompt])
    assert row["label"] == "42" and row["question"] == "What is 17 + 25?" and row["reward_info"] == {"pred": "41"}

    script = load_script("samples")
    shown = script.show(row, width=60)
    assert "question:   What is 17 + 25?" in shown and "label:      42" in shown and '"pred": "41"' in shown
    older = {k: v for k, v in row.items() if k not in ("question", "label")}  # a file written before these columns
    assert "What is 17 + 25?" in script.show(older, width=60)  # the prompt's tail, where the question is


def test_a_run_warns_once_when_answers_hit_the_length_limit_and_groups_carry_no_signal(tmp_path, caplog):
    """2 new tokens cut nearly every answer, and a constant reward leaves every group without signal: each
    is said once, with the setting to change and the metric that shows it, which metrics.jsonl holds."""
    import logging

    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "trainer.max_steps=3", "~callbacks.held_out_eval", "rollout.max_new_tokens=2",
        "task.reward._target_=tests.conftest.constant_reward")))
    with caplog.at_level(logging.WARNING, logger="glmlight"):
        run.fit()
    metrics, _ = read_metrics(str(tmp_path))
    steps = [m for m in metrics.values() if "rollout/truncated_frac" in m]
    assert len(steps) == 3 and all(m["rollout/truncated_frac"] > 0.5 for m in steps)
    assert all(m["rollout/equal_reward_group_frac"] == 1.0 for m in steps)
    cut = [r.getMessage() for r in caplog.records if "rollout.max_new_tokens" in r.getMessage()]
    flat = [r.getMessage() for r in caplog.records if "rollout/equal_reward_group_frac" in r.getMessage()]
    assert len(cut) == 1 and "rollout.max_new_tokens=2" in cut[0] and "rollout/truncated_frac" in cut[0], cut
    assert len(flat) == 1 and "rollout.n_samples_per_prompt" in flat[0] and "task" in flat[0], flat


def test_run_health_counts_groups_by_trajectory_and_stays_quiet_below_its_thresholds(caplog):
    """Segments of one agent trajectory count once; groups of one have no baseline to compare with; a critic
    algorithm (no group baseline) is never told about equal rewards; each warning comes once."""
    import logging
    from types import SimpleNamespace

    from glmlight.callbacks import RunHealth
    from glmlight.data.rollout_stats import equal_reward_group_frac
    from glmlight.sample import Sample

    def sample(group, rollout, reward, status="completed"):
        return Sample(prompt_ids=[1], response_ids=[2], loss_mask=[1], rollout_logprobs=[0.0], versions=[0],
                      reward=reward, status=status, group_id=group, rollout_id=rollout)

    # group 0: two segments of one trajectory and another trajectory, rewards differ; group 1: all equal
    batch = [sample(0, 0, 1.0), sample(0, 0, 1.0), sample(0, 1, 0.0), sample(1, 2, 0.5), sample(1, 3, 0.5)]
    assert equal_reward_group_frac(batch) == 0.5
    assert equal_reward_group_frac([sample(0, 0, 1.0), sample(1, 1, 1.0)]) is None  # groups of one

    cfg = SimpleNamespace(max_new_tokens=7, max_context=64, n_samples_per_prompt=2, dynamic_sampling=False)
    trainer = SimpleNamespace(is_global_zero=True, datamodule=SimpleNamespace(cfg=cfg))
    grpo, critic = SimpleNamespace(rl_step=3, group_baseline=True), SimpleNamespace(rl_step=3, group_baseline=False)
    health = RunHealth()
    with caplog.at_level(logging.WARNING, logger="glmlight"):
        health.on_train_batch_end(trainer, grpo, None, SimpleNamespace(samples=batch), 0)  # 50%: not most
        assert not caplog.records
        flat = [sample(0, 0, 1.0, "truncated"), sample(0, 1, 1.0, "truncated"), sample(1, 2, 0.0)]
        health_critic = RunHealth()
        health_critic.on_train_batch_end(trainer, critic, None, SimpleNamespace(samples=flat), 0)
        assert [r.getMessage().split(":")[0] for r in caplog.records] == ["RL step 3"]  # only the length
        assert "rollout.max_new_tokens=7" in caplog.records[0].getMessage()
        caplog.clear()
        for _ in range(2):
            health.on_train_batch_end(trainer, grpo, None, SimpleNamespace(samples=flat), 0)
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 2 and "rollout.n_samples_per_prompt=2" in said[1] and "100%" in said[1], said
