"""PolicyScoring's entropy: without gradient it runs a few positions at a time; the values are the ones of
the whole batch at once, 0 off the mask, under the sampling distribution's top-k."""

import torch

from glmlight.algorithms import scoring
from glmlight.algorithms.grpo import GRPO, GRPOConfig
from glmlight.models.loading import load_causal_lm
from glmlight.models.tokenizer import build_char_tokenizer
from glmlight.ops.logprobs import entropy_from_logits


def test_entropy_without_gradient_in_chunks_equals_the_whole_batch(monkeypatch):
    tok = build_char_tokenizer()
    module = GRPO(GRPOConfig(), load_causal_lm(None, tok, preset="test", seed=0), temperature=0.7, top_k=5)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 40, generator=g)[:, 1:]  # a strided view, as the trainer's logits slices are
    mask = torch.ones(3, 5)
    mask[0, 3:] = 0
    mask[2, 0] = 0
    want = entropy_from_logits(logits, 0.7, 5) * mask
    monkeypatch.setattr(scoring, "ENTROPY_CHUNK_ELEMENTS", 2 * 40)  # two positions per chunk: 7 chunks
    got = module.scoring.entropy(logits, mask, with_grad=False)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not got.requires_grad
    with_grad = module.scoring.entropy(logits.clone().requires_grad_(), mask, with_grad=True)
    torch.testing.assert_close(with_grad.detach(), want, rtol=0, atol=1e-6)
    assert with_grad.requires_grad
