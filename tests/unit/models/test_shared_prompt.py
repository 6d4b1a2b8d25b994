"""glmlight.models.shared_prompt: a batch whose rows repeat prompts, with each prompt's forward run once,
against the forward over every row (logits and gradients), and where it must not apply."""

from __future__ import annotations

import random

import pytest
import torch

from glmlight.models import shared_prompt
from glmlight.sample import Experience, Sample
from tests.support.thread_timing import backward_nodes, gradients_beside_a_busy_thread
from tests.support.tolerances import dims, gradient_tolerances, model_logit_tolerance, within

VOCAB = 97


def _model(kind: str = "llama", **overrides) -> torch.nn.Module:
    """A tiny randomly initialised `kind` (tests/support/hf_models.py's shapes) over a vocabulary of VOCAB."""
    from tests.support.hf_models import _configs

    class Vocab:  # what _configs reads of a tokenizer
        pad_token_id, eos_token_id = 0, 1

        def __len__(self) -> int:
            return VOCAB

    config_cls, model_cls, kw = _configs(Vocab())[kind]
    torch.manual_seed(0)
    return model_cls(config_cls(**{**kw, **overrides})).float().train()


def _batch(groups: list[int], seed: int = 0) -> Experience:
    """Groups of rows sharing a prompt; prompts of different lengths (left padding) and responses of
    different lengths (right padding)."""
    g = random.Random(seed)
    samples = []
    for gid, n in enumerate(groups):
        prompt = [g.randrange(2, VOCAB) for _ in range(g.randrange(3, 9))]
        for _ in range(n):
            resp = [g.randrange(2, VOCAB) for _ in range(g.randrange(1, 7))]
            samples.append(Sample(prompt_ids=prompt, response_ids=resp, loss_mask=[1] * len(resp),
                                  rollout_logprobs=[-1.0] * len(resp), versions=[0] * len(resp), reward=0.0,
                                  group_id=gid))
    return Experience.collate(samples, 0)


def _full_logits(model: torch.nn.Module, exp: Experience) -> torch.Tensor:
    P = exp.prompt_length
    out = model(input_ids=exp.input_ids, attention_mask=exp.attention_mask, position_ids=exp.position_ids,
                use_cache=False)
    return out.logits[:, P - 1 : -1]


def _loss(logits: torch.Tensor, exp: Experience) -> torch.Tensor:
    lp = torch.log_softmax(logits, -1).gather(-1, exp.response_ids[..., None]).squeeze(-1)
    weights = torch.linspace(-1.0, 1.0, exp.batch_size)[:, None]
    return -(lp * weights * exp.response_mask).sum()


def test_prompt_groups_finds_the_rows_that_share_a_prompt():
    exp = _batch([3, 1, 2])
    first, inverse = shared_prompt.prompt_groups(exp)
    groups = [s.group_id for s in exp.samples]
    assert len(first) == 3
    # rows of one group map to one distinct prompt, and `first` holds a row of each
    assert [inverse[i] == inverse[j] for i in range(6) for j in range(6)] == \
        [groups[i] == groups[j] for i in range(6) for j in range(6)]
    assert sorted(groups[int(f)] for f in first) == [0, 1, 2]
    assert shared_prompt.prompt_groups(_batch([1, 1, 1])) is None  # nothing shared


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_shared_prompt_forward_gives_the_logits_and_gradients_of_the_full_forward(kind):
    model = _model(kind)
    exp = _batch([3, 2, 1, 2])
    run = shared_prompt.plan(model, exp)
    assert run is not None
    mask = exp.response_mask.bool()

    model.zero_grad(set_to_none=True)
    full = _full_logits(model, exp)
    _loss(full, exp).backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    model.zero_grad(set_to_none=True)
    shared = run()
    _loss(shared, exp).backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    assert shared.shape == full.shape
    # one forward per prompt against one per row: other shapes, float32 rounding apart
    rows = [s.prompt_ids + s.response_ids for s in exp.samples]
    tol = model_logit_tolerance(model, rows)
    assert (shared - full)[mask].abs().max() <= tol
    assert got.keys() == want.keys()
    # the same terms summed over the rows' positions in another grouping (a prompt's once); each tensor
    # against its own scale (tests/support/tolerances.py, gradient_tolerances)
    size = {**dims(model.config), "context": max(map(len, rows)), "tokens": sum(map(len, rows))}
    assert within(got, want, gradient_tolerances(want, **size)) == []


def test_one_token_responses_need_only_the_prompt_forward():
    model = _model()
    g = random.Random(1)
    prompt = [g.randrange(2, VOCAB) for _ in range(5)]
    samples = [Sample(prompt_ids=prompt, response_ids=[g.randrange(2, VOCAB)], loss_mask=[1], rollout_logprobs=[-1.0],
                      versions=[0], reward=0.0, group_id=0) for _ in range(3)]
    exp = Experience.collate(samples, 0)
    tol = model_logit_tolerance(model, [s.prompt_ids + s.response_ids for s in samples])
    assert torch.allclose(shared_prompt.plan(model, exp)(), _full_logits(model, exp), atol=tol, rtol=0)


def test_it_does_not_apply_where_it_would_not_be_exact():
    exp = _batch([2, 2])
    assert shared_prompt.plan(_model(attention_dropout=0.1), exp) is None  # copies would share dropout masks
    assert shared_prompt.plan(_model(attention_dropout=0.1).eval(), exp) is not None  # no dropout in eval
    checkpointed = _model()
    checkpointed.gradient_checkpointing_enable()
    assert shared_prompt.plan(checkpointed, exp) is None  # transformers drops the cache then
    sliding = _model(layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    assert shared_prompt.plan(sliding, exp) is None  # not a plain key/value cache


def test_glm5_with_its_index_cache_is_not_shared():
    from glmlight.models.loading import load_causal_lm
    from glmlight.models.tokenizer import build_char_tokenizer

    model = load_causal_lm(None, build_char_tokenizer(), preset="test", seed=0)
    assert shared_prompt.cache_argument(model) is None


def test_the_gradient_does_not_depend_on_thread_timing():
    """The rows of a group are summed back into its prompt's keys and values by index_add_ (index by
    index), not by indexing's backward (index_put_ with accumulate on CPU: threads adding into one row in
    the order they reach it). Rows of each group in both threads' halves of the batch, a busy thread beside."""
    model = _model(hidden_size=192, num_attention_heads=3, num_key_value_heads=3, head_dim=64)
    g = random.Random(0)
    samples = []
    for gid in range(4):
        prompt = [g.randrange(2, VOCAB) for _ in range(g.randrange(40, 50))]
        for _ in range(8):
            resp = [g.randrange(2, VOCAB) for _ in range(g.randrange(10, 30))]
            samples.append(Sample(prompt_ids=prompt, response_ids=resp, loss_mask=[1] * len(resp),
                                  rollout_logprobs=[-1.0] * len(resp), versions=[0] * len(resp), reward=0.0,
                                  group_id=gid))
    random.Random(1).shuffle(samples)
    exp = Experience.collate(samples, 0)
    assert "IndexBackward0" not in backward_nodes(shared_prompt.plan(model, exp)())
    grads = gradients_beside_a_busy_thread(model, lambda: _loss(shared_prompt.plan(model, exp)(), exp))
    assert all(torch.equal(grads[0], g) for g in grads[1:])
