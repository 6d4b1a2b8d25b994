"""The ordered experts forward (glmlight/models/experts.py) that glmlight selects for Hugging Face MoE models."""
from __future__ import annotations

import pytest
import torch

from glmlight.models.experts import SORTED
from glmlight.models.loading import load_causal_lm
from glmlight.models.tokenizer import build_char_tokenizer
from tests.support.thread_timing import backward_nodes, gradients_beside_a_busy_thread
from tests.support.tolerances import dims, gradient_tolerances, model_logit_tolerance, within

ARCHES = ["glm4moe", "glm4moe_lite", "glm5"]


def _model(arch: str, **overrides) -> torch.nn.Module:
    return load_causal_lm(None, build_char_tokenizer(), preset="test", arch=arch, seed=0, **overrides)


def _batch(vocab: int, rows: int = 6, length: int = 40) -> torch.Tensor:
    return torch.randint(2, vocab, (rows, length), generator=torch.Generator().manual_seed(0))


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=ids).logits
    return logits, torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ARCHES)
def test_a_loaded_moe_model_computes_its_experts_with_the_ordered_forward(arch):
    assert _model(arch).config._experts_implementation == SORTED


@pytest.mark.parametrize("arch", ARCHES)
def test_the_ordered_forward_gives_the_logits_and_gradients_of_transformers_own(arch):
    """Against transformers' eager experts loop (one expert at a time, gathered by indexing): the same sums in
    another order, float32 rounding apart (tests/support/tolerances.py)."""
    model = _model(arch)
    ids = _batch(model.config.vocab_size)
    logits, loss = _loss(model, ids)
    loss.backward()
    got = _grads(model)

    model.zero_grad(set_to_none=True)
    model.set_experts_implementation("eager")
    want_logits, loss = _loss(model, ids)
    loss.backward()
    want = _grads(model)

    rows = ids.tolist()
    assert (logits - want_logits).abs().max() <= model_logit_tolerance(model, rows)
    assert got.keys() == want.keys()
    size = {**dims(model.config), "context": ids.shape[1], "tokens": ids.numel()}
    assert within(got, want, gradient_tolerances(want, **size)) == []


def test_the_gradient_does_not_depend_on_thread_timing():
    """Each token's k expert copies are summed back by index_add_ (index by index), not by indexing's backward
    (index_put_ with accumulate on CPU: threads adding into one row in the order they reach it); a GLM-4.5-style
    model (top-8 of 16 experts) at 2 threads with a busy thread beside. transformers' grouped_mm forward gave 7
    gradients in 8 backwards here."""
    model = _model("glm4moe", hidden_size=192, moe_intermediate_size=96, n_routed_experts=16, num_experts_per_tok=8)
    ids = _batch(model.config.vocab_size, rows=8, length=64)
    assert "IndexBackward0" not in backward_nodes(_loss(model, ids)[1])
    grads = gradients_beside_a_busy_thread(model, lambda: _loss(model, ids)[1], times=8)
    assert all(torch.equal(grads[0], g) for g in grads[1:])
