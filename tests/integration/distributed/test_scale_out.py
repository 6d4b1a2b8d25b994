"""Scale-out on this machine: two-process data-parallel GRPO over gloo; DeepSpeed / FSDP selection."""

import json

import pytest
import torch

import glmlight
from glmlight.errors import ConfigError
from tests.conftest import REPO, overrides_for_tests
from tests.support.scripts.fixed_batches import launch
from glmlight import compose


def test_two_process_ddp_grpo_keeps_ranks_identical(tmp_path):
    out = launch("tests.support.scripts.ddp_grpo", str(tmp_path), cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = []
    for r in (0, 1):
        with open(tmp_path / f"rank{r}.jsonl") as f:
            ranks.append([json.loads(line) for line in f])
    assert [row["rl_step"] for row in ranks[0]] == [1, 2, 3] == [row["rl_step"] for row in ranks[1]]
    for a, b in zip(*ranks):
        # identical parameters on both ranks after every step, and each rank's engine serves them
        assert a["sum"] == b["sum"] and a["sq"] == b["sq"]
        assert a["engine_sum"] == a["sum"] and b["engine_sum"] == b["sum"]
        assert a["engine_version"] == b["engine_version"] == a["rl_step"]
        assert set(a["prompts"]).isdisjoint(b["prompts"])  # rollouts are sharded across ranks
    assert ranks[0][0]["sum"] != ranks[0][-1]["sum"]  # and they did train


def test_deepspeed_and_fsdp_selection(tmp_path):
    import importlib.util

    from glmlight.strategies.fsdp import RLFSDPStrategy

    if importlib.util.find_spec("deepspeed") is None:
        with pytest.raises(ConfigError, match=r"trainer.strategy=deepspeed needs the deepspeed package"):
            glmlight.build(compose(overrides_for_tests(tmp_path, "trainer.strategy=deepspeed")))
    # FSDP2 runs on CPUs too (tests/system/test_fsdp.py); bf16-mixed becomes FSDP2's MixedPrecisionPolicy
    run = glmlight.build(compose(overrides_for_tests(tmp_path, "trainer.strategy=fsdp", "trainer.precision=bf16-mixed")))
    strategy = run.trainer.strategy
    assert isinstance(strategy, RLFSDPStrategy)
    assert (strategy.param_dtype, strategy.reduce_dtype) == (torch.bfloat16, torch.float32)
