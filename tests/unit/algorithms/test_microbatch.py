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
from tests.support.scripts.fixed_batches import Recorder, ReplayData, max_gap


def test_packing_by_hand():
    lengths = torch.tensor([5, 20, 6, 4, 21])
    prompts = torch.zeros(5, dtype=torch.long)
    rows = torch.arange(5)
    # longest first: 21, 20 (2 x 21 = 42 <= 48), then 6, 5, 4 (3 x 6 = 18; 21 + 6 would be 3 x 21 = 63 > 48)
    assert [c.tolist() for c in by_tokens(rows, prompts, lengths, 48)] == [[4, 1], [2, 0, 3]]
    # a row longer than the budget runs alone; 5 and 4 fit together (2 x 5 = 10); rows keep their own index
    assert [c.tolist() for c in by_tokens(rows + 10, prompts, lengths, 10)] == [[14], [11], [12], [10, 13]]
    assert [c.tolist() for c in by_rows(rows, 2)] == [[0, 1], [2, 3], [4]]
    assert by_tokens(rows[:0], prompts[:0], lengths[:0], 8) == [] == by_rows(rows[:0], 2)
    # the width is the longest prompt plus the longest response: 3 + 4 and 1 + 6 run 2 x (3 + 6) = 18 wide
    two = torch.arange(2)
    assert len(by_tokens(two, torch.tensor([3, 1]), torch.tensor([4, 6]), 17)) == 2
    assert len(by_tokens(two, torch.tensor([3, 1]), torch.tensor([4, 6]), 18)) == 1


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
    # the same sums over the batch's tokens, split into other micro-batches: float32 reassociation only
    # (tests/support/tolerances.py); a micro-batch counted twice or normalised by its own size is O(|g|)
    from tests.support.tolerances import adamw_first_step_tolerance, gradient_tolerance, within

    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    dims = {"hidden": 64, "intermediate": 128, "context": max(lengths), "tokens": sum(lengths)}  # model.preset=test
    tols = [gradient_tolerance(a, **dims) for a in rows["grads"]]
    for a, b, tol in zip(rows["grads"], tokens["grads"], tols):
        assert max_gap(a, b) <= tol, (max_gap(a, b), tol)
    # one AdamW step from the same weights: each parameter from its own optimizer's (only) step
    lr = max(compose(overrides_for_tests(tmp_path, *extra)).algo.lr, 1e-3)  # sao's critic_lr: 1e-3
    bound = {}
    for n, theta in rows["params"][-1].items():
        i = next((i for i, g in enumerate(rows["grads"]) if n in g and g[n].abs().max() > 0), None)
        grad, tol = (rows["grads"][i][n], tols[i]) if i is not None else (torch.zeros_like(theta), 0.0)
        bound[n] = adamw_first_step_tolerance(grad, tol, theta, lr=lr)  # no gradient: no step, no difference
    assert within(rows["params"][-1], tokens["params"][-1], bound) == []


def test_the_budget_bounds_the_padded_width_of_prompt_and_response():
    """A trimmed micro-batch is as wide as its longest prompt plus its longest response (prompts are
    left-padded, responses right-padded): rows of 100 + 10 and 10 + 100 tokens run 2 x 200 = 400
    padded tokens together, so a budget of 220 must keep them apart."""
    tok = build_char_tokenizer()
    long_prompt = encode_chat(tok, [{"role": "user", "content": "1" * 90}])
    short_prompt = encode_chat(tok, [{"role": "user", "content": ""}])
    samples = [Sample(prompt_ids=p, response_ids=[5] * n, loss_mask=[1] * n, rollout_logprobs=[-1.0] * n,
                      versions=[0] * n, rollout_id=i) for i, (p, n) in enumerate([(long_prompt, 10), (short_prompt, 100)])]
    exp = Experience.collate(samples, pad_token_id=0)
    P = exp.prompt_length
    prompts, responses = exp.attention_mask[:, :P].sum(-1), exp.response_mask.sum(-1).long()
    for budget in (220, 400, 1000):
        for chunk in by_tokens(torch.arange(2), prompts, responses, budget):
            mb = trim(exp.select(chunk))
            assert len(chunk) == 1 or mb.input_ids.numel() <= budget, (budget, chunk.tolist(), mb.input_ids.shape)
    assert len(by_tokens(torch.arange(2), prompts, responses, 220)) == 2
    assert len(by_tokens(torch.arange(2), prompts, responses, 2 * exp.input_ids.shape[1])) == 1


def test_token_micro_batches_run_packed_trimmed_forwards(tmp_path, monkeypatch):
    """The equal-gradient test above holds whether or not rows are packed; this one fails when they are
    not: with algo.micro_batch_tokens every forward the update runs is a packed micro-batch of at most
    the budget's padded tokens (one long row runs alone), never the whole minibatch."""
    from glmlight.algorithms.scoring import PolicyScoring

    widths = []
    real = PolicyScoring.forward_logits

    def spy(self, model, exp, *args, **kw):
        widths.append(tuple(exp.input_ids.shape))
        return real(self, model, exp, *args, **kw)

    monkeypatch.setattr(PolicyScoring, "forward_logits", spy)
    samples = _samples([40, 3, 4, 3, 2, 3, 5, 3])
    _one_step(tmp_path, "tokens", samples, "algo.micro_batch_tokens=64")
    full = Experience.collate(samples, pad_token_id=0).input_ids.shape
    assert widths and all(shape != tuple(full) for shape in widths), widths
    assert sum(b for b, _ in widths) % len(samples) == 0  # every row in exactly one micro-batch per pass
    for b, t in widths:
        assert b == 1 or b * t <= 64, widths
    assert max(b for b, _ in widths) > 1  # short rows do share a micro-batch


def test_trainer_side_teacher_scoring_keeps_the_token_budget(monkeypatch):
    """OPD's trainer-side teacher scores in the policy's micro-batches: packed by the token budget, each
    forward at most the budget's padded tokens, and the same log-probs as one forward over all rows."""
    from glmlight.algorithms.teachers import ModelTeacher
    from glmlight.algorithms.scoring import PolicyScoring
    from glmlight.config.schema import validate
    from glmlight.models.loading import load_causal_lm
    from glmlight.config.registry import algorithm
    from tests.support.tolerances import model_logprob_tolerance

    tok = build_char_tokenizer()
    teacher_model = load_causal_lm(None, tok, preset="test", seed=1).eval()
    exp = Experience.collate(_samples([40, 3, 4, 3, 2, 3, 5, 3]), pad_token_id=tok.pad_token_id)
    out = {}
    for name, extra in (("rows", "algo.micro_batch_size=64"), ("tokens", "algo.micro_batch_tokens=64")):
        cfg = validate(compose(["model.preset=test", extra]))
        module = algorithm("grpo").module(cfg.algo, load_causal_lm(None, tok, preset="test", seed=0),
                                          pad_token_id=tok.pad_token_id, use_glm_forward=True)
        module.teacher_temperature = 1.0
        widths = []
        real = PolicyScoring.forward_logits

        def spy(self, model, mb, *args, **kw):
            widths.append(tuple(mb.input_ids.shape))
            return real(self, model, mb, *args, **kw)

        monkeypatch.setattr(PolicyScoring, "forward_logits", spy)
        out[name] = ModelTeacher("t", teacher_model).logprobs(module, exp) * exp.response_mask
        monkeypatch.setattr(PolicyScoring, "forward_logits", real)
        if name == "tokens":
            assert len(widths) > 1 and all(b == 1 or b * t <= 64 for b, t in widths), widths
    # different micro-batch shapes run other matmul blockings: float32 rounding apart (tests/support/tolerances.py)
    tol = model_logprob_tolerance(teacher_model, [s.prompt_ids + s.response_ids for s in exp.samples])
    torch.testing.assert_close(out["rows"], out["tokens"], rtol=0, atol=tol)


def test_the_logged_policy_loss_does_not_depend_on_the_micro_batches(tmp_path):
    """train/pg_loss is the minibatch's policy loss however it is split: each micro-batch's term is already its
    share of the minibatch's loss (divided by the whole minibatch's normaliser), so the shares add up; a mean
    over 4 micro-batches logged a quarter of it."""
    import json

    samples = _samples([6, 3, 4, 3, 2, 3, 5, 3])
    logged = {}
    for name, size in (("one", 8), ("four", 2)):
        _one_step(tmp_path, name, samples, f"algo.micro_batch_size={size}", "algo.loss_agg=token_mean")
        rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
        logged[name] = next((r["train/pg_loss"], r["train/loss"]) for r in rows if "train/pg_loss" in r)
    (pg_one, loss_one), (pg_four, loss_four) = logged["one"], logged["four"]
    assert loss_four == pytest.approx(loss_one, rel=1e-5, abs=1e-7)
    assert pg_one == pytest.approx(loss_one, rel=1e-5, abs=1e-7)  # no KL or entropy term: the loss is the policy loss
    assert pg_four == pytest.approx(pg_one, rel=1e-5, abs=1e-7)
