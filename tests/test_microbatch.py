"""Micro-batches by token budget (algo.micro_batch_tokens): packing and trimming by hand, and the same
loss and gradients as row micro-batches on a batch of mixed lengths."""

import math

import pytest
import torch

import glmlight
from glmlight import compose
from glmlight.algorithms.microbatch import by_rows, by_tokens, place_rows, trim
from glmlight.models.tokenizer import build_char_tokenizer, encode_chat
from glmlight.sample import Experience, Sample
from tests.conftest import overrides_for_tests
from tests.scripts.fixed_batches import Recorder, ReplayData, max_gap


def test_packing_by_hand():
    lengths = torch.tensor([5, 20, 6, 4, 21])
    rows = torch.arange(5)
    # longest first: 21, 20 (2 x 21 = 42 <= 48), then 6, 5, 4 (3 x 6 = 18; 21 + 6 would be 3 x 21 = 63 > 48)
    assert [c.tolist() for c in by_tokens(rows, lengths, 48)] == [[4, 1], [2, 0, 3]]
    # a row longer than the budget runs alone; 5 and 4 fit together (2 x 5 = 10); rows keep their own index
    assert [c.tolist() for c in by_tokens(rows + 10, lengths, 10)] == [[14], [11], [12], [10, 13]]
    assert [c.tolist() for c in by_rows(rows, 2)] == [[0, 1], [2, 3], [4]]
    assert by_tokens(rows[:0], lengths[:0], 8) == [] == by_rows(rows[:0], 2)


def _samples(lengths, seed=0):
    tok = build_char_tokenizer()
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        prompt = encode_chat(tok, [{"role": "user", "content": "1+" * (i % 3) + "2="}])
        ids = torch.randint(5, 60, (n,), generator=g).tolist()
        out.append(Sample(prompt_ids=prompt, response_ids=ids, loss_mask=[1] * n,
                          rollout_logprobs=[-math.log(len(tok))] * n, versions=[0] * n,
                          reward=float(i % 4) / 3, group_id=i // 4, rollout_id=i, metadata={"prompt_index": i}))
    return out


def test_trim_keeps_every_used_column():
    exp = Experience.collate(_samples([2, 9, 3]), pad_token_id=0)
    mb = trim(exp.select([0, 2]))
    P = exp.prompt_length
    assert mb.response_length == 3 and mb.prompt_length == int(exp.attention_mask[[0, 2], :P].sum(-1).max())
    assert torch.equal(mb.response_ids, exp.response_ids[[0, 2], :3])
    assert mb.attention_mask.sum() == exp.attention_mask[[0, 2]].sum()  # only padding was cut
    assert torch.equal(place_rows([(torch.tensor([2, 0]), torch.ones(2, 3))], 3, 9)[:, :4],
                       torch.tensor([[1.0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 0]]))


def _one_step(tmp_path, name, samples, *extra):
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path / name, "trainer.max_steps=1", "~callbacks.held_out_eval", "~callbacks.sample_table",
        "rollout.max_new_tokens=40", "algo.grad_clip=0", *extra)))
    run.datamodule = ReplayData(run.datamodule, [[samples]])
    rec = Recorder(str(tmp_path / f"{name}.pt"))
    run.trainer.callbacks.append(rec)
    run.fit()
    return torch.load(tmp_path / f"{name}.pt")


@pytest.mark.parametrize("extra", [
    ["algo.loss_agg=seq_mean_token_mean", "algo.old_logprobs=forward", "algo.kl_coef=0.1"],
    ["algo=sao", "rollout.mode=sync", "algo.critic_warmup_steps=0", "algo.critic_updates=1"],
])
def test_token_micro_batches_give_the_row_micro_batches_gradients(tmp_path, extra):
    samples = _samples([40, 3, 4, 3, 2, 3, 5, 3])  # one long response among short ones
    rows = _one_step(tmp_path, "rows", samples, "algo.micro_batch_size=3", *extra)
    tokens = _one_step(tmp_path, "tokens", samples, "algo.micro_batch_tokens=64", *extra)
    assert len(rows["grads"]) == len(tokens["grads"]) > 0
    for a, b in zip(rows["grads"], tokens["grads"]):
        assert max_gap(a, b) <= 1e-6 * max(1.0, max(float(v.abs().max()) for v in a.values()))
    assert max_gap(rows["params"][-1], tokens["params"][-1]) <= 1e-6
