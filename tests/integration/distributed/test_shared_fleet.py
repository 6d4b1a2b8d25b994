"""Data-parallel ranks and servers placed apart: two trainer processes over gloo share one fleet of two real
servers instead of one engine each (slow: the servers take minutes to start here)."""

import json
import os
import socket
import subprocess
import sys

import pytest

from glmlight.models.tiny_checkpoint import build_tiny_checkpoint
from tests.conftest import REPO
from tests.support.real_servers import interpreter
from tests.support.scripts.fixed_batches import launch

pytestmark = pytest.mark.slow


def _check_ranks(out_dir) -> None:
    ranks = [[json.loads(line) for line in open(out_dir / f"rank{r}.jsonl")] for r in (0, 1)]
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


def test_two_ddp_ranks_share_one_fleet_that_rank_0_launched_and_pushes_into(tmp_path):
    """Rank 0 launches two vLLM servers; rank 1 joins them as a client (it launches nothing). Both ranks spread
    their own shard of the prompts over the same servers; after every step rank 0 pushes the averaged weights
    once and rank 1 adopts the version, so every sample of either rank carries the version of its step; the
    ranks' parameters stay identical; the servers are gone when the run ends."""
    python = interpreter("vllm")
    ckpt = build_tiny_checkpoint(str(tmp_path / "tiny"), "llama", seed=0)
    out = launch("tests.support.scripts.ddp_fleet", str(tmp_path / "out"), "vllm", python, ckpt, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    _check_ranks(tmp_path / "out")


def test_two_torchrun_nodes_share_one_fleet_at_the_addresses_given(tmp_path):
    """`torchrun --nnodes=2` on one host, two rendezvous nodes of one process each, started at once: the node-0
    rank launches two vLLM servers at the URLs given, the node-1 rank waits for them and joins; the same checks."""
    python = interpreter("vllm")
    ckpt = build_tiny_checkpoint(str(tmp_path / "tiny"), "llama", seed=0)
    ports = []
    for _ in range(3):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    urls = f"http://127.0.0.1:{ports[0]},http://127.0.0.1:{ports[1]}"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                               f"--node-rank={n}", "--master-addr=127.0.0.1", f"--master-port={ports[2]}", "-m",
                               "tests.support.scripts.ddp_fleet", str(tmp_path / "out"), "vllm", python, ckpt, urls],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in (0, 1)]
    logs = [p.communicate(timeout=1500)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    _check_ranks(tmp_path / "out")
