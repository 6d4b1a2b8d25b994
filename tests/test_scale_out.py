"""Scale-out on this machine: two-process data-parallel GRPO over gloo; DeepSpeed / FSDP selection."""

import json
import subprocess
import sys

import pytest

import glmlight
from glmlight.errors import ConfigError
from tests.conftest import REPO, overrides_for_tests
from glmlight import compose


def test_two_process_ddp_grpo_keeps_ranks_identical(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tests.scripts.ddp_grpo", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
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


def test_deepspeed_and_fsdp_selection_give_clear_errors_here(tmp_path):
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        with pytest.raises(ConfigError, match=r"trainer.strategy=deepspeed needs the deepspeed package"):
            glmlight.build(compose(overrides_for_tests(tmp_path, "trainer.strategy=deepspeed")))
    # Lightning's FSDP needs GPUs; on a CPU machine the config stops with one line saying so.
    with pytest.raises(ConfigError, match=r"strategy=fsdp.*requires a GPU accelerator"):
        glmlight.build(compose(overrides_for_tests(tmp_path, "trainer.strategy=fsdp")))
