"""algo.share_prompt_forward in a real training step: a GRPO step of a transformers model on a batch of
groups (rows repeating a prompt) runs each prompt's forward once and makes the same update as the
forward over every row."""

import math

import torch

import glmlight
from glmlight import compose
from glmlight.models.tokenizer import build_char_tokenizer, encode_chat
from glmlight.sample import Sample
from tests.conftest import overrides_for_tests
from tests.support.hf_models import build_tiny_hf
from tests.support.scripts.fixed_batches import Recorder, ReplayData, max_gap


def _groups(n_prompts=3, group=4, seed=0):
    tok = build_char_tokenizer()
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in range(n_prompts):
        prompt = encode_chat(tok, [{"role": "user", "content": "1+" * (p + 1) + "2="}])  # prompts of different lengths
        for j in range(group):
            n = int(torch.randint(2, 12, (1,), generator=g))
            ids = torch.randint(5, 60, (n,), generator=g).tolist()
            out.append(Sample(prompt_ids=prompt, response_ids=ids, loss_mask=[1] * n,
                              rollout_logprobs=[-math.log(len(tok))] * n, versions=[0] * n,
                              reward=float((p + j) % 3) / 2, group_id=p, rollout_id=len(out),
                              metadata={"prompt_index": p}))
    return out


def _step(tmp_path, name, model_path, samples, *extra):
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path / name, "model=hf", f"model.path={model_path}", "model.dtype=float32", "trainer.max_steps=1",
        "~callbacks.held_out_eval", "~callbacks.sample_table", "algo.grad_clip=0", *extra)))
    run.datamodule = ReplayData(run.datamodule, [[samples]])
    rec = Recorder(str(tmp_path / f"{name}.pt"))
    run.trainer.callbacks.append(rec)
    run.fit()
    return torch.load(tmp_path / f"{name}.pt")


def test_a_shared_prompt_forward_makes_the_same_update(tmp_path, monkeypatch):
    from glmlight.models import shared_prompt

    path = build_tiny_hf("llama", str(tmp_path / "models"))
    samples = _groups()
    calls = []
    real = shared_prompt.forward_logits

    def spy(model, exp, first, inverse, **kw):
        calls.append((exp.batch_size, len(first)))
        return real(model, exp, first, inverse, **kw)

    monkeypatch.setattr(shared_prompt, "forward_logits", spy)
    # the KL term needs the reference's log-probs and a forward for the old log-probs: every scoring path
    extra = ("algo.kl_coef=0.1", "algo.old_logprobs=forward")
    shared = _step(tmp_path, "shared", path, samples, *extra)
    assert calls and all(distinct == 3 and rows == 12 for rows, distinct in calls), calls
    calls.clear()
    each = _step(tmp_path, "each", path, samples, "algo.share_prompt_forward=false", *extra)
    assert not calls
    assert len(shared["grads"]) == len(each["grads"]) == 1
    # the same sums over the batch's tokens from other forwards: float32 reassociation (tests/support/tolerances.py)
    from transformers import AutoConfig

    from tests.support.tolerances import adamw_first_step_tolerance, dims, gradient_tolerance, within

    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    tol = gradient_tolerance(each["grads"][0], **dims(AutoConfig.from_pretrained(path)), context=max(lengths),
                             tokens=sum(lengths))
    assert max_gap(shared["grads"][0], each["grads"][0]) <= tol, (max_gap(shared["grads"][0], each["grads"][0]), tol)
    # AdamW's first step is about lr x sign(gradient): elements whose gradient is within tol of 0 may move by up to lr
    lr = compose(overrides_for_tests(tmp_path)).algo.lr
    bound = {k: adamw_first_step_tolerance(g, tol, each["params"][-1][k], lr=lr) for k, g in each["grads"][0].items()}
    assert within(shared["params"][-1], each["params"][-1], bound) == []
