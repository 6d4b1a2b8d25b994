"""glmlight.models.glm5.forward against the model's own forward (transformers' GlmMoeDsaForCausalLM).

Every comparison is at the real (attention_mask = 1) positions of batches whose rows are padded on
both sides (left-padded prompt, right-padded response), in fp32, where the two must agree up to
float reassociation: logits within model_logit_tolerance, gradients within gradient_tolerances
(tests/support/tolerances.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from glmlight.models.glm5.forward import forward_logits, supports
from glmlight.models.loading import load_causal_lm
from tests.support.tolerances import dims, gradient_tolerances, model_logit_tolerance, within

PROMPT = 12  # prompt columns: the response starts at position 12


def _batch(vocab: int, B: int = 4, S: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask, position_ids as the trainer builds them: each row is one run of real
    tokens, after left padding (prompt) and before right padding (response). Row 0 is padded 3 | 5."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, S, dtype=torch.long)
    mask[0, 3:S - 5] = 1
    for b in range(1, B):  # at least 2 prompt and 2 response tokens
        left = int(torch.randint(0, PROMPT - 2, (1,), generator=g))
        right = int(torch.randint(0, S - PROMPT - 2, (1,), generator=g))
        mask[b, left:S - right] = 1
    ids = torch.randint(6, vocab, (B, S), generator=g) * mask
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _model(tokenizer, **overrides) -> torch.nn.Module:
    model = load_causal_lm(None, tokenizer, preset="test", seed=0, **overrides)
    # the reference computes its experts with transformers' own forward, not glmlight's (models/experts.py)
    model.set_experts_implementation("grouped_mm")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # attention_bias: non-zero biases, so that a missing one shows
        for name, p in model.named_parameters():
            if name.endswith(("q_a_proj.bias", "kv_a_proj_with_mqa.bias", "o_proj.bias")):
                p.normal_(0, 0.1, generator=g)
    return model


def _reference(model, ids, mask, pos) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits


def _rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's real tokens (positions 0.. as position_ids number them)."""
    return [r[m.bool()].tolist() for r, m in zip(ids, mask)]


def _response_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ log p(token) over the real response tokens, from logits of positions PROMPT - 1 .. S - 2."""
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, PROMPT:, None])[..., 0]
    return (logp * mask[:, PROMPT:]).sum()


CASES = {
    # S = 40 <= top-k 64: every allowed key is selected, the indexer does not run
    "dense": {},
    # top-k 8 < S = 40 with 2 indexer heads: index scores tie at exactly 0 often (ReLU)
    "sparse": {"index_topk": 8},
    # + a "shared" layer reusing the previous layer's top-k, a "full" last layer, biased projections
    "sparse+shared+bias": {"index_topk": 8, "num_hidden_layers": 3, "indexer_types": ["full", "shared", "full"],
                           "attention_bias": True},
    # + the last layer "shared", a group-limited router (2 groups, top-1 group)
    "sparse+shared last+groups": {"index_topk": 8, "num_hidden_layers": 3,
                                  "indexer_types": ["full", "full", "shared"], "n_group": 2, "topk_group": 1},
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_the_models_at_real_positions(tokenizer, case):
    model = _model(tokenizer, **CASES[case]).eval()
    ids, mask, pos = _batch(len(tokenizer))
    with torch.no_grad():
        expected = _reference(model, ids, mask, pos)
        tol = model_logit_tolerance(model, _rows(ids, mask), context=ids.shape[1])  # other kernels: float32 apart
        for start in (0, PROMPT - 1):  # the trainer asks for the positions predicting the response
            logits = forward_logits(model, ids, mask, pos, start=start)
            real = mask[:, start:].bool()
            assert logits.shape == (4, 40 - start, len(tokenizer))
            torch.testing.assert_close(logits[real], expected[:, start:][real], atol=tol, rtol=0)
            assert (logits[~real] == 0).all()
    model.train()  # no dropout in the model: training mode computes the same function, with autograd
    torch.testing.assert_close(forward_logits(model, ids, mask, pos, start=PROMPT - 1).detach(), logits)


def test_the_sparse_cases_hinge_on_the_tie_rule(tokenizer):
    # The model glmlight loads breaks DSA ties at the top-k cut-off as the engine does (the equality
    # above); transformers' own indexer (Tensor.topk) chooses among them otherwise on these batches.
    model = _model(tokenizer, **CASES["sparse"]).eval()
    ids, mask, pos = _batch(len(tokenizer))
    real = mask.bool()
    with torch.no_grad():
        ours = forward_logits(model, ids, mask, pos)
        for layer in model.model.layers:
            del layer.self_attn.indexer.forward  # back to the class's forward
        theirs = _reference(model, ids, mask, pos)
    assert (ours[real] - theirs[real]).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["dense", "sparse+shared+bias"])
def test_parameter_gradients_equal_the_models(tokenizer, case):
    model = _model(tokenizer, **CASES[case]).train()
    ids, mask, pos = _batch(len(tokenizer), seed=1)
    _response_loss(_reference(model, ids, mask, pos)[:, PROMPT - 1:-1], ids, mask).backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    _response_loss(forward_logits(model, ids, mask, pos, start=PROMPT - 1)[:, :-1], ids, mask).backward()
    got = {}
    for name, p in model.named_parameters():
        if expected[name] is None:  # the DSA indexer's weights: no gradient in the model either
            assert ".indexer." in name and p.grad is None, name
        else:
            got[name] = p.grad
    want = {name: g for name, g in expected.items() if g is not None}
    # sums over the batch's real positions in other orders; each tensor against its own scale, so that a
    # missing bias or a wrong mask in a small tensor's gradient does not hide under the embeddings'
    size = {**dims(model.config), "context": ids.shape[1], "tokens": int(mask.sum())}
    assert within(got, want, gradient_tolerances(want, **size)) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_on_both_sides_stays_finite(tokenizer, dtype):
    """Row 0 is padded on both sides, row 3 is all padding: padding queries see no key (a fully
    masked softmax row) and must not turn into NaN, forward or backward."""
    model = _model(tokenizer, **CASES["sparse+shared+bias"]).to(dtype).train()
    ids, mask, pos = _batch(len(tokenizer))
    mask[3] = 0
    ids, pos = ids * mask, (mask.cumsum(-1) - 1).clamp(min=0)
    logits = forward_logits(model, ids, mask, pos, start=PROMPT - 1)
    assert logits.dtype == dtype and torch.isfinite(logits).all()
    _response_loss(logits[:, :-1].float(), ids, mask).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.inference_mode():
        torch.testing.assert_close(forward_logits(model.eval(), ids, mask, pos, start=PROMPT - 1), logits.detach())


def test_supports_only_the_glm_dsa_models_it_reproduces(tokenizer):
    model = _model(tokenizer)
    assert supports(model)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    assert not supports(llama)
    model.gradient_checkpointing_enable()  # the model's own forward then trades compute for memory
    assert not supports(model)
