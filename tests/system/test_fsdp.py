"""Sharded training for real, on two CPU processes over gloo, with the real engine, rewards, weight
sync and sharded checkpoints: trainer.strategy=fsdp (FSDP2: fully_shard through Lightning's
ModelParallelStrategy) and trainer.strategy=deepspeed (ZeRO-2 / ZeRO-3 on DeepSpeed's CPU
accelerator; skipped where deepspeed is not installed)."""

import csv
import glob
import os

import pytest
import torch

import glmlight
from glmlight import compose
from glmlight.errors import ConfigError
from tests.conftest import REPO, overrides_for_tests
from tests.support.scripts.fsdp_run import replay_single_process
from tests.support.scripts.fixed_batches import launch, max_gap
from tests.support.tolerances import adamw_first_step_tolerance, gradient_tolerances, within

TIMING = ("seconds", "per_s")  # wall-clock metrics differ between any two runs


def _launch(out, algo, *args, rc=0):
    proc = launch("tests.support.scripts.fsdp_run", str(out), algo, *args, cwd=REPO)
    assert proc.returncode == rc, proc.stderr[-4000:]
    if rc:
        return None
    return torch.load(os.path.join(out, "record-resumed.pt" if "--resume" in args else "record.pt"))


def _check_against_one_process(tmp_path, algo, record, extra, dtensors=True):
    assert record["sharded"] == dtensors  # FSDP2: the policy's parameters were DTensor shards
    assert max(max(e) for e in record["engine_gap"]) == 0.0  # both ranks' engines served the trained weights
    one = replay_single_process(str(tmp_path / "one"), algo, record, extra)
    gaps = [max_gap(two, single) for two, single in zip(record["params"], one["params"])]
    print(f"{algo}: gathered parameters vs one process, per step:", gaps)
    assert len(gaps) == len(record["params"])
    # The first RL step starts from the same weights: the ranks' gradients are the one process's up to the
    # float32 order of their sums (gradient_tolerances), so each parameter is within adamw_first_step_tolerance
    # of the one process's after its optimizer's first step (tests/support/tolerances.py). A rank's gradient
    # not reduced, or reduced with the wrong factor, moves it by O(lr). After that the parameters differ (a
    # gradient near zero moves its parameter by up to lr either way) and so do later gradients: later steps
    # are not compared element-wise (the resumed run is, exactly, in _kill_and_resume).
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in one["samples"]]
    size = {"hidden": 64, "intermediate": 128, "context": max(lengths), "tokens": sum(lengths)}  # model.preset=test
    bounds = [gradient_tolerances(g, **size) for g in one["grads"]]
    step = {}
    for n, theta in one["params"][0].items():
        i = next((i for i, g in enumerate(one["grads"]) if n in g and g[n].abs().max() > 0), None)
        grad, tol = (one["grads"][i][n], bounds[i][n]) if i is not None else (torch.zeros_like(theta), 0.0)
        step[n] = adamw_first_step_tolerance(grad, tol, theta, lr=one["lr"])  # no gradient: no step, no difference
    assert within(record["params"][0], one["params"][0], step) == []
    assert max_gap(record["params"][0], record["params"][-1]) > 1e-5  # and they did train


def _metrics(out) -> dict[int, dict[str, float]]:
    """Logged metrics by step, every CSV version of the run merged (a resumed run writes a new one)."""
    by_step: dict[int, dict[str, float]] = {}
    for path in sorted(glob.glob(os.path.join(out, "csv", "version_*", "metrics.csv"))):
        with open(path) as f:
            for row in csv.DictReader(f):
                step = by_step.setdefault(int(row["step"]), {})
                step.update({k: float(v) for k, v in row.items() if v != "" and k != "step"})
    return by_step


def _kill_and_resume(tmp_path, whole, extra):
    """A run killed after its step-2 checkpoint and resumed logs the same metrics as the uninterrupted
    one and reaches the same parameters."""
    _launch(tmp_path / "b", "grpo", "--kill-at", "3", *extra, rc=3)
    assert (tmp_path / "b" / "checkpoints" / "last.ckpt").is_dir()  # sharded: a directory, a shard per rank
    resumed = _launch(tmp_path / "b", "grpo", "--resume", *extra)
    assert len(resumed["params"]) == 2  # steps 3 and 4
    assert max_gap(resumed["params"][-1], whole["params"][-1]) == 0.0
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    compared = 0
    for step in (2, 3):  # the metrics of RL steps 3 and 4 (logged at the steps completed before them)
        for key, value in b[step].items():
            if not any(t in key for t in TIMING):
                assert a[step][key] == value, (step, key)
                compared += 1
    assert compared > 20


@pytest.mark.slow
def test_fsdp_grpo_equals_one_process_and_resumes_exactly(tmp_path):
    """GRPO through glmlight's GLM-5 forward: every step's gathered parameters equal one process on the
    same global batch; killed after a checkpoint and resumed, it continues exactly."""
    extra = ["model.forward=glmlight"]
    whole = _launch(tmp_path / "a", "grpo", *extra)
    _check_against_one_process(tmp_path, "grpo", whole, extra)
    _kill_and_resume(tmp_path, whole, extra)
    assert list((tmp_path / "b" / "checkpoints" / "last.ckpt").glob("*.distcp"))  # torch.distributed.checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_grpo_equals_one_process_and_resumes_exactly(tmp_path, stage):
    pytest.importorskip("deepspeed")
    extra = ["--strategy", "deepspeed", f"trainer.zero_stage={stage}"]
    whole = _launch(tmp_path / "a", "grpo", *extra)
    _check_against_one_process(tmp_path, "grpo", whole, [f"trainer.zero_stage={stage}"], dtensors=False)
    _kill_and_resume(tmp_path, whole, extra)


@pytest.mark.slow
def test_fsdp_sao_equals_one_process(tmp_path):
    """SAO (policy, critic, running value statistics) through the models' own forward; no critic warm-up,
    so that the policy steps in the first RL step too (the one compared element-wise)."""
    extra = ["model.forward=transformers", "algo.critic_warmup_steps=0"]
    _check_against_one_process(tmp_path, "sao", _launch(tmp_path / "s", "sao", *extra), extra)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["opd", "compaction"])
def test_fsdp_opd_and_compaction_equal_one_process(tmp_path, algo):
    """OPD (trainer-side teacher kept whole on each rank) and CompactionRL (segments: ranks hold
    different numbers of rows), two steps each."""
    extra = ["trainer.max_steps=2"]
    _check_against_one_process(tmp_path, algo, _launch(tmp_path / algo, algo, *extra), extra)


@pytest.mark.slow
def test_fsdp_bf16_mixed_precision_trains(tmp_path):
    """trainer.precision=bf16-mixed: FSDP2's MixedPrecisionPolicy (bf16 all-gathers and compute over
    gloo, fp32 reductions and master weights); the engines hold the fp32 weights."""
    record = _launch(tmp_path / "bf16", "grpo", "trainer.precision=bf16-mixed", "trainer.max_steps=2",
                     "trainer.checkpoint_every_n_steps=0")
    assert record["sharded"] and max(max(e) for e in record["engine_gap"]) == 0.0
    assert all(torch.isfinite(v).all() for v in record["params"][-1].values())
    assert max_gap(record["params"][0], record["params"][-1]) > 1e-5


def test_sharded_config_checks(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.strategy=fsdp takes trainer.precision"):
        glmlight.build(compose(overrides_for_tests(tmp_path, "trainer.strategy=fsdp", "trainer.precision=16-true")))
    pytest.importorskip("deepspeed")
    from glmlight.strategies.zero import RLDeepSpeedStrategy

    run = glmlight.build(compose(overrides_for_tests(tmp_path, "algo=sao", "trainer.strategy=deepspeed")))
    assert isinstance(run.trainer.strategy, RLDeepSpeedStrategy)
    with pytest.raises(ConfigError, match=r"deepspeed takes one optimizer.*SAO trains a policy and a critic"):
        run.trainer.strategy.configure_for(run.module)
