"""Global loss normalisers: N data-parallel ranks train exactly like one process on the union of their
batches (token mean, sequence mean without fully masked rows, SAO's advantage whitening and running
value statistics), under glmlight's data parallelism (ddp) and FSDP2 (fsdp)."""


import pytest
import torch

from glmlight import compose
from tests.conftest import REPO
from tests.support.scripts.dp_normalisers import CASES, overrides, rank_samples, run_case
from tests.support.scripts.fixed_batches import launch, max_gap
from tests.support.tolerances import adamw_first_step_tolerance, gradient_tolerances, within


def _two_process(tmp_path, strategy: str) -> None:
    out = launch("tests.support.scripts.dp_normalisers", str(tmp_path), strategy, cwd=REPO)
    assert out.returncode == 0, out.stderr[-4000:]


@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp"])  # ddp (slow): the
# default run keeps FSDP here and DDP in tests/integration/distributed/test_scale_out.py
def test_two_ranks_train_like_one_process_on_the_union(tmp_path, strategy):
    _two_process(tmp_path, strategy)
    problems, gaps = [], {}
    # the same sums over the union's tokens, split across ranks and micro-batches otherwise: float32 order
    # only (tests/support/tolerances.py); a rank normalising by its own token or row count moves every
    # gradient by O(|g|)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for r in (0, 1) for s in rank_samples(r)]
    size = {"hidden": 64, "intermediate": 128, "context": max(lengths), "tokens": sum(lengths)}  # model.preset=test
    for case in CASES:
        two = torch.load(tmp_path / f"{case}-2.pt")
        one = torch.load(run_case(str(tmp_path / "one"), case, 1, "auto"))
        assert len(two["grads"]) == len(one["grads"]) > 0, case
        assert two["sharded"] == (strategy == "fsdp") and not one["sharded"], case  # DTensor shards under fsdp
        bounds = [gradient_tolerances(g1, **size) for g1 in one["grads"]]
        for i, (g2, g1, bound) in enumerate(zip(two["grads"], one["grads"], bounds)):
            if within(g2, g1, bound):
                problems.append(f"{case}: gradients of optimizer step {i} differ in {within(g2, g1, bound)} "
                                f"(largest gap {max_gap(g2, g1):.3g})")
        # one RL step, each parameter from its own optimizer's only step (SAO: the policy's and the critic's)
        algo = compose(overrides(str(tmp_path), case, 1, "auto")).algo
        lr = max(algo.lr, getattr(algo, "critic_lr", 0.0))
        step = {}
        for n, theta in one["params"][-1].items():
            i = next((i for i, g in enumerate(one["grads"]) if n in g and g[n].abs().max() > 0), None)
            grad, tol = (one["grads"][i][n], bounds[i][n]) if i is not None else (torch.zeros_like(theta), 0.0)
            step[n] = adamw_first_step_tolerance(grad, tol, theta, lr=lr)  # no gradient: no step, no difference
        gaps[case] = max_gap(two["params"][-1], one["params"][-1])
        if within(two["params"][-1], one["params"][-1], step):
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
