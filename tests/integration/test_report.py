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
from glmlight.report import read_metrics, summarize, write_report
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
        "+callbacks.icepop._target_=callbacks.IcePop", "+callbacks.icepop.keep_in_denominator=false",
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
