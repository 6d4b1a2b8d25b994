"""Data-parallel ranks and servers placed apart: two trainer processes over gloo share one fleet of two real
servers instead of one engine each (slow: the servers take minutes to start here)."""

import json

import pytest

from glmlight.models.tiny_checkpoint import build_tiny_checkpoint
from tests.conftest import REPO
from tests.support.real_servers import interpreter
from tests.support.scripts.fixed_batches import launch

pytestmark = pytest.mark.slow


def test_two_ddp_ranks_share_one_fleet_that_rank_0_launched_and_pushes_into(tmp_path):
    """Rank 0 launches two vLLM servers; rank 1 joins them as a client (it launches nothing). Both ranks spread
    their own shard of the prompts over the same servers; after every step rank 0 pushes the averaged weights
    once and rank 1 adopts the version, so every sample of either rank carries the version of its step; the
    ranks' parameters stay identical; the servers are gone when the run ends."""
    python = interpreter("vllm")
    ckpt = build_tiny_checkpoint(str(tmp_path / "tiny"), "llama", seed=0)
    out = launch("tests.support.scripts.ddp_fleet", str(tmp_path / "out"), "vllm", python, ckpt, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [[json.loads(line) for line in open(tmp_path / "out" / f"rank{r}.jsonl")] for r in (0, 1)]
    assert [row["rl_step"] for row in ranks[0]] == [1, 2, 3] == [row["rl_step"] for row in ranks[1]]
    for a, b in zip(*ranks):
        print(f"\nstep {a['rl_step']}: versions {a['versions']} / {b['versions']}, engines at {a['engine_version']}")
        assert a["urls"] == b["urls"] and len(a["urls"]) == 2  # one fleet
        assert a["owns"] and not b["owns"] and len(a["launched"]) == 2 and b["launched"] == []
        assert a["sum"] == b["sum"] and a["sq"] == b["sq"]
        assert a["engine_version"] == b["engine_version"] == a["rl_step"]
        assert a["versions"] == b["versions"] == [a["rl_step"] - 1]  # on-policy on both ranks
        assert set(a["prompts"]).isdisjoint(b["prompts"])  # each rank its own shard of the prompts
    from tests.integration.servers.test_fleet import _group

    assert all(_group(g) == [] for g in ranks[0][-1]["pgids"]), "a server outlived the run"
