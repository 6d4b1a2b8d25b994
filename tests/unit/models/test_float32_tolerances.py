"""The log-prob tolerances of tests/support/tolerances.py against the rounding error they estimate, measured on
this machine's kernels: one float32 forward against a float64 forward of the same weights."""

import pytest
import torch

from tests.support.tolerances import float32_error_of, logprob_error, logprob_tolerance, model_logprob_tolerance


def test_the_estimate_follows_the_arithmetic():
    base = dict(hidden=128, intermediate=256, context=32, vocab=102, logit_max=9.0)
    tol = logprob_tolerance(**base)
    assert tol == 2 * logprob_error(**base)  # two computations, each within its error of the exact value
    assert 1.9 * tol < logprob_tolerance(**{**base, "logit_max": 18.0}) < 2 * tol  # linear in max|z|
    # the square root of the reduction length: 4x every width and the context, about 2x the tolerance
    four = {**base, "hidden": 512, "intermediate": 1024, "context": 128}
    assert 1.9 * tol < logprob_tolerance(**four) < 2.1 * tol
    assert 1e-4 < tol < 2e-4  # the tiny Llama of the server tests: ~1e-4


@pytest.mark.parametrize("seed", [0, 1])
def test_one_float32_forward_is_within_the_estimated_error(tmp_path, seed):
    """The estimate holds on whatever CPU runs this: a float32 forward's log-probs are within
    `logprob_error` of the float64 forward, so two float32 computations are within twice that."""
    from glmlight.models.tiny_checkpoint import build_tiny_checkpoint
    from glmlight.models.loading import load_causal_lm, load_tokenizer

    path = build_tiny_checkpoint(str(tmp_path / "tiny"), "llama", seed=seed)
    model = load_causal_lm(path, load_tokenizer(path)).eval()
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(5, 95, (n,), generator=g).tolist() for n in (24, 300)]
    for ids in seqs:
        measured = float32_error_of(model, ids)
        tol = model_logprob_tolerance(model, [ids])
        print(f"\n{len(ids)} tokens: one float32 forward is {measured:.2e} from float64; tolerance {tol:.2e}")
        assert 0 < measured <= tol / 2
