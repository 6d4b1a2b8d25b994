"""On-policy distillation: the advantage formula, routing to one teacher per sample, teacher
prefill log-probs (trainer-side checkpoint and engine), outcome-reward mixing, the real loop."""

import csv
import glob
import os

import pytest
import torch
from glmlight import compose

import glmlight
from glmlight.algorithms.opd import OPD
from glmlight.config import validate
from glmlight.errors import ConfigError, DataError
from glmlight.models.loading import load_causal_lm, save_checkpoint
from glmlight.ops.advantages import group_advantages
from glmlight.ops.distill import mix_outcome_advantages, opd_advantages, reverse_kl
from glmlight.ops.logprobs import logprobs_from_logits
from glmlight.sample import Experience, Sample
from tests.conftest import encode, overrides_for_tests


# ------------------------------------------------------------------------------------------ the formula
def test_opd_advantage_by_hand():
    teacher = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, -1.0]], requires_grad=True)
    student = torch.tensor([[-1.5, -1.0, -0.5], [-0.7, -1.0, -9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = opd_advantages(teacher, student, mask)
    assert torch.allclose(adv, torch.tensor([[0.5, -1.0, 0.0], [0.5, -2.0, 8.0]]))
    assert not adv.requires_grad  # sg(·): the advantage carries no gradient
    assert torch.allclose(opd_advantages(teacher, student, mask, coef=2.0), 2 * adv)
    mixed = mix_outcome_advantages(adv, torch.tensor([2.0, -1.0]), mask, orm_coef=0.5)
    assert torch.allclose(mixed, torch.tensor([[1.5, 0.0, 0.0], [0.0, -2.5, 7.5]]))
    # reverse KL = mean over masked tokens of (student - teacher): (-0.5 + 1 - 0.5 + 2 - 8) / 5
    assert reverse_kl(student, teacher, mask).item() == pytest.approx(-6.0 / 5)
    assert torch.allclose(reverse_kl(student, teacher, mask, dim=-1), torch.tensor([0.25, -6.5 / 3]))
    with pytest.raises(ValueError, match="shapes differ"):
        opd_advantages(teacher[:, :2], student, mask)


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def teacher_dirs(tmp_path_factory, tokenizer):
    """Two tiny GLM-5 teachers (different init seeds) saved as Hugging Face checkpoints."""
    out = {}
    for name, seed in (("A", 1), ("B", 2)):
        path = str(tmp_path_factory.mktemp("teachers") / name)
        save_checkpoint(load_causal_lm(None, tokenizer, preset="test", seed=seed), tokenizer, path)
        out[name] = path
    return out


def engine_from_checkpoint(path: str):
    """An engine spec target for tests: the embedded engine serving a local checkpoint."""
    from glmlight.rollout.local import LocalEngine

    return LocalEngine(load_causal_lm(path, None), pad_token_id=0)


def _module(tiny_model, temperature=1.0, **algo):
    cfg = validate({"algo": {"name": "opd", **algo}}).algo
    return OPD(cfg, tiny_model, temperature=temperature, max_new_tokens=4, pad_token_id=0)


def _batch(tokenizer, domains, rewards=None, group_size=1):
    samples = []
    for i, domain in enumerate(domains):
        response = [tokenizer.convert_tokens_to_ids(c) for c in str(10 + 7 * i)[: 1 + i % 2]]
        samples.append(Sample(prompt_ids=encode(tokenizer, f"{i}+{i * 3}=" + "9" * i), response_ids=response,
                              loss_mask=[1] * len(response), rollout_logprobs=[-1.0] * len(response),
                              versions=[0] * len(response), group_id=i // group_size, rollout_id=i,
                              reward=None if rewards is None else rewards[i], metadata={"domain": domain}))
    return Experience.collate(samples, pad_token_id=tokenizer.pad_token_id)


def _forward_logprobs(model, sample, temperature=1.0):
    """The teacher's log-probs of one sample's response tokens: a plain forward pass, no padding."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(sample.prompt_ids) - 1 : -1]
    return logprobs_from_logits(logits.unsqueeze(0), torch.tensor([sample.response_ids]), temperature)[0]


# ------------------------------------------------------------------------------------------ routing / prefill
@pytest.mark.parametrize("serve", ["trainer", "engine", "spec"])
def test_each_sample_scored_by_exactly_its_teacher(tokenizer, tiny_model, teacher_dirs, serve):
    a = {"path": teacher_dirs["A"], "domains": ["math"]}
    if serve == "spec":
        b = {"engine": {"_target_": "tests.test_opd.engine_from_checkpoint", "path": teacher_dirs["B"]},
             "domains": ["agent", "tool"]}
    else:
        b = {"path": teacher_dirs["B"], "serve": serve, "domains": ["agent", "tool"]}
    module = _module(tiny_model, teachers={"A": a, "B": b})
    batch = _batch(tokenizer, ["math", "agent", "math", "tool", "agent"])
    assert module.route(batch.samples) == ["A", "B", "A", "B", "B"]
    module.prepare_experience(batch)
    models = {name: load_causal_lm(path, None).eval() for name, path in teacher_dirs.items()}
    for i, (s, name) in enumerate(zip(batch.samples, module.route(batch.samples))):
        n = s.response_length
        expected = _forward_logprobs(models[name], s)
        other = _forward_logprobs(models["B" if name == "A" else "A"], s)
        assert torch.allclose(batch.teacher_logprobs[i, :n], expected, atol=1e-4), (i, name)
        assert not torch.allclose(batch.teacher_logprobs[i, :n], other, atol=1e-3)  # one teacher, not a mix
        assert torch.all(batch.teacher_logprobs[i, n:] == 0)
    assert batch.stats["opd/frac/A"] == pytest.approx(0.4) and batch.stats["opd/frac/B"] == pytest.approx(0.6)
    kl = reverse_kl(batch.old_logprobs, batch.teacher_logprobs, batch.loss_mask).item()
    assert batch.stats["opd/reverse_kl"] == pytest.approx(kl)
    assert "opd/reverse_kl/A" in batch.stats and "opd/reverse_kl/B" in batch.stats
    assert not any("teacher" in k for k in module.state_dict())  # never trained, never checkpointed
    module.teardown("fit")


def test_unknown_domain_and_default_teacher(tokenizer, tiny_model, teacher_dirs):
    teachers = {"A": {"path": teacher_dirs["A"], "domains": ["math"]},
                "B": {"path": teacher_dirs["B"], "domains": ["agent"]}}
    batch = _batch(tokenizer, ["math", "code"])
    with pytest.raises(DataError, match=r"domain 'code'.*known domains: \['agent', 'math'\]"):
        _module(tiny_model, teachers=teachers).route(batch.samples)
    module = _module(tiny_model, teachers=teachers, default_teacher="B")
    assert module.route(batch.samples) == ["A", "B"]
    # a single teacher without domains serves everything
    single = _module(tiny_model, teachers={"only": {"path": teacher_dirs["A"]}})
    assert single.route(batch.samples) == ["only", "only"]


@pytest.mark.parametrize("algo, message", [
    ({"teachers": {}}, "algo.teachers is empty"),
    ({"teachers": {"t": {"path": "/x", "engine": {"_target_": "a.B"}}}}, "give path or engine, not both"),
    ({"teachers": {"t": {"path": "/x", "domains": ["m"]}, "u": {"path": "/y", "domains": ["m"]}}}, "listed by both"),
    ({"teachers": {"t": {"path": "/x"}}, "default_teacher": "v"}, "default_teacher='v' is not a teacher"),
    ({"teachers": {"t": {"path": "/x", "domains": ["m"]}, "u": {"path": "/y"}}}, "teachers.u lists no domains"),
    ({"teachers": {"t": {"pth": "/x"}}}, "unknown key 'algo.teachers.t.pth'"),
    ({"teachers": {"t": {"path": "/x", "serve": "gpu"}}}, "serve='gpu' is not one of"),
    ({"teachers": {"t": {"engine": {"urls": []}}}}, "engine needs a _target_"),
])
def test_teacher_config_errors(tiny_model, algo, message):
    with pytest.raises(ConfigError, match=message):
        _module(tiny_model, **algo)


def test_teacher_vocabulary_must_match(tokenizer, tmp_path):
    path = str(tmp_path / "big_vocab")
    model = load_causal_lm(None, tokenizer, preset="test", seed=0)
    model.resize_token_embeddings(len(tokenizer) + 8)
    save_checkpoint(model, tokenizer, path)
    student = load_causal_lm(None, tokenizer, preset="test", seed=0)
    with pytest.raises(ConfigError, match="vocabulary"):
        _module(student, teachers={"t": {"path": path}}).teachers()


# ------------------------------------------------------------------------------------------ advantages
def test_orm_coef_mixes_group_advantages(tokenizer, tiny_model, teacher_dirs):
    module = _module(tiny_model, teachers={"A": {"path": teacher_dirs["A"]}}, orm_coef=0.5)
    batch = _batch(tokenizer, ["math"] * 4, rewards=[1.0, 0.0, 0.0, 0.0], group_size=2)
    module.prepare_experience(batch)
    module.compute_advantages(batch)
    orm = group_advantages(batch.rewards, torch.tensor([0, 0, 1, 1]))
    assert torch.allclose(orm, torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-5)
    expected = (batch.teacher_logprobs - batch.old_logprobs) * batch.loss_mask + 0.5 * orm.unsqueeze(-1) * batch.loss_mask
    assert torch.allclose(batch.advantages, expected, atol=1e-6)
    plain = _module(tiny_model, teachers={"A": {"path": teacher_dirs["A"]}})
    plain.prepare_experience(batch)
    plain.compute_advantages(batch)
    assert torch.allclose(batch.advantages, (batch.teacher_logprobs - batch.old_logprobs) * batch.loss_mask)


@pytest.mark.parametrize("serve", ["trainer", "engine"])
def test_teacher_scores_at_the_student_temperature(tokenizer, tiny_model, teacher_dirs, serve):
    # The student's log-probs are taken at the rollout temperature; the teacher's must be too (by
    # default), so the advantage compares the same distribution. teacher_temperature overrides it.
    teacher = load_causal_lm(teacher_dirs["A"], None).eval()
    batch = _batch(tokenizer, ["math", "math"])
    for setting, expected_t in ((None, 0.7), (1.0, 1.0)):
        module = _module(tiny_model, temperature=0.7, teacher_temperature=setting,
                         teachers={"A": {"path": teacher_dirs["A"], "serve": serve}})
        module.prepare_experience(batch)
        for i, s in enumerate(batch.samples):
            n = s.response_length
            assert torch.allclose(batch.teacher_logprobs[i, :n], _forward_logprobs(teacher, s, expected_t), atol=1e-4)
            assert not torch.allclose(batch.teacher_logprobs[i, :n],
                                      _forward_logprobs(teacher, s, 1.7 - expected_t), atol=1e-3)
        module.teardown("fit")


def test_orm_term_with_one_sample_per_prompt_is_the_raw_reward(tokenizer, tiny_model, teacher_dirs):
    # GLM-5's OPD group size is 1: a centred reward would be 0 for every sample (a silent no-op).
    module = _module(tiny_model, teachers={"A": {"path": teacher_dirs["A"]}}, orm_coef=0.5)
    batch = _batch(tokenizer, ["math"] * 3, rewards=[1.0, 0.0, 0.25], group_size=1)
    module.prepare_experience(batch)
    module.compute_advantages(batch)
    opd = (batch.teacher_logprobs - batch.old_logprobs) * batch.loss_mask
    expected = opd + 0.5 * torch.tensor([1.0, 0.0, 0.25]).unsqueeze(-1) * batch.loss_mask
    assert torch.allclose(batch.advantages, expected, atol=1e-5)
    assert batch.stats["opd/orm_advantage_abs_mean"] > 0


# ------------------------------------------------------------------------------------------ the real loop
def _metrics(tmp_path):
    with open(glob.glob(os.path.join(str(tmp_path), "csv", "*", "metrics.csv"))[0]) as f:
        return list(csv.DictReader(f))


def test_opd_fit_builtin_teacher_with_icepop(tmp_path):
    """`algo=opd` as shipped (the built-in warm-started teacher), shrunk for a test, with IcePop."""
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "algo=opd", "rollout.n_samples_per_prompt=1", "algo.teachers.tiny150.preset=test",
        "algo.teachers.tiny150.warm_start.steps=2", "algo.teachers.tiny150.warm_start.batch_size=8",
        f"algo.teachers.tiny150.warm_start.cache_dir={tmp_path}/cache", "+callbacks.icepop._target_=callbacks.IcePop",
        "~callbacks.held_out_eval", "~callbacks.sample_table", "trainer.checkpoint_every_n_steps=1")))
    before = {k: v.clone() for k, v in run.module.policy.state_dict().items()}
    run.fit()
    assert any(not torch.equal(before[k], v) for k, v in run.module.policy.state_dict().items())
    assert run.module.policy_version == 2
    rows = [r for r in _metrics(tmp_path) if r.get("opd/reverse_kl")]
    assert len(rows) == 2 and all(r["opd/frac/tiny150"] == "1.0" and r["icepop/popped_frac"] for r in rows)
    ckpt = torch.load(os.path.join(str(tmp_path), "checkpoints", "last.ckpt"), weights_only=False)
    assert all(k.startswith("policy.") for k in ckpt["state_dict"])  # the teacher is not checkpointed


def test_opd_fit_checkpoint_teachers_orm_and_dis(tmp_path, teacher_dirs):
    """Two checkpoint teachers routed by domain (arithmetic prompts are 'math'), ORM mixing, DIS loss."""
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "algo=opd", "~algo.teachers.tiny150", "algo.default_teacher=null",
        f"+algo.teachers.A={{path:{teacher_dirs['A']},domains:[math]}}",
        f"+algo.teachers.B={{path:{teacher_dirs['B']},serve:engine,domains:[agent]}}",
        "algo.orm_coef=0.5", "algo.policy_loss=dis", "~callbacks.held_out_eval", "~callbacks.sample_table")))
    run.fit()
    rows = [r for r in _metrics(tmp_path) if r.get("opd/reverse_kl")]
    assert len(rows) == 2
    assert all(float(r["opd/frac/A"]) == 1.0 and float(r["opd/frac/B"]) == 0.0 for r in rows)
    assert all(r["opd/orm_advantage_abs_mean"] and r["train/dis_masked_frac"] for r in rows)
