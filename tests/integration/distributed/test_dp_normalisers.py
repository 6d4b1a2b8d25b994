"""Global loss normalisers: N data-parallel ranks train exactly like one process on the union of their
batches (token mean, sequence mean without fully masked rows, SAO's advantage whitening and running
value statistics), under glmlight's data parallelism (ddp) and FSDP2 (fsdp)."""


import pytest
import torch

from tests.conftest import REPO
from tests.support.scripts.dp_normalisers import CASES, run_case
from tests.support.scripts.fixed_batches import launch, max_gap


def _two_process(tmp_path, strategy: str) -> None:
    out = launch("tests.support.scripts.dp_normalisers", str(tmp_path), strategy, cwd=REPO)
    assert out.returncode == 0, out.stderr[-4000:]


@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp"])  # ddp (slow): the
# default run keeps FSDP here and DDP in tests/integration/distributed/test_scale_out.py
def test_two_ranks_train_like_one_process_on_the_union(tmp_path, strategy):
    _two_process(tmp_path, strategy)
    problems, gaps = [], {}
    for case in CASES:
        two = torch.load(tmp_path / f"{case}-2.pt")
        one = torch.load(run_case(str(tmp_path / "one"), case, 1, "auto"))
        assert len(two["grads"]) == len(one["grads"]) > 0, case
        assert two["sharded"] == (strategy == "fsdp") and not one["sharded"], case  # DTensor shards under fsdp
        for i, (g2, g1) in enumerate(zip(two["grads"], one["grads"])):
            gap = max_gap(g2, g1)
            scale = max(float(v.abs().max()) for v in g1.values())
            if gap > 1e-6 * max(scale, 1.0):
                problems.append(f"{case}: gradients of optimizer step {i} differ by {gap:.3g} (largest {scale:.3g})")
        gaps[case] = max_gap(two["params"][-1], one["params"][-1])
        if gaps[case] > 1e-6:
            problems.append(f"{case}: parameters differ by {gaps[case]:.3g} after the step")
        if max(max(e) for e in two["engine_gap"]) != 0.0:  # each rank's engine serves the trained weights
            problems.append(f"{case}: an engine's weights differ from the trainer's")
    print(f"{strategy}: largest parameter gap per case", gaps)
    assert not problems, "; ".join(problems)


def test_seq_mean_token_mean_leaves_fully_masked_rows_out():
    from glmlight.ops.reduce import aggregate_loss

    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # token means 2 and 4 of the two rows with tokens; the masked row is no sequence: (2 + 4) / 2 = 3
    assert aggregate_loss(loss, mask, "seq_mean_token_mean").item() == pytest.approx(3.0)
