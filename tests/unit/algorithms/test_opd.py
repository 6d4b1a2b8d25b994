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
from glmlight.config.schema import validate
from glmlight.errors import ConfigError, DataError
from glmlight.models.loading import load_causal_lm, save_checkpoint
from glmlight.ops.advantages import group_advantages
from glmlight.ops.distill import full_reverse_kl, mix_outcome_advantages, opd_advantages, reverse_kl
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


def test_full_reverse_kl_by_hand():
    # student logits [0, 0] -> p = (1/2, 1/2); teacher [ln 3, 0] -> q = (3/4, 1/4):
    # KL(p || q) = 1/2 ln(2/3) + 1/2 ln 2 = 0.143841; at temperature 2 the teacher is (√3, 1)/(√3 + 1).
    student = torch.zeros(1, 2, 2, requires_grad=True)
    teacher = torch.tensor([[[torch.log(torch.tensor(3.0)), 0.0], [0.0, 0.0]]])
    mask = torch.tensor([[1.0, 0.0]])
    kl = full_reverse_kl(student, teacher, mask)
    assert kl[0, 0].item() == pytest.approx(0.5 * torch.log(torch.tensor(2 / 3)).item() + 0.5 * torch.log(torch.tensor(2.0)).item())
    assert kl[0, 1].item() == 0.0
    q = torch.tensor([3 ** 0.5, 1.0]) / (3 ** 0.5 + 1)
    assert full_reverse_kl(student, teacher, mask, teacher_temperature=2.0)[0, 0].item() == pytest.approx(
        float((0.5 * (torch.log(torch.tensor(0.5)) - q.log())).sum()), rel=1e-5)
    # its gradient is the reverse KL's: d/dz_v = p_v (log p_v − log q_v − KL); the teacher gets none
    kl[0, 0].backward()
    p = torch.tensor([0.5, 0.5])
    log_ratio = p.log() - torch.tensor([0.75, 0.25]).log()
    assert torch.allclose(student.grad[0, 0], p * (log_ratio - (p * log_ratio).sum()), atol=1e-6)
    assert torch.all(student.grad[0, 1] == 0)
    with pytest.raises(ValueError, match="do not match"):
        full_reverse_kl(student, teacher[:, :1], mask)


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
    from glmlight.engines.local.engine import LocalEngine

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
        b = {"engine": {"_target_": "tests.unit.algorithms.test_opd.engine_from_checkpoint",
                        "path": teacher_dirs["B"]},
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


def test_full_distill_loss_is_the_exact_kl_to_each_rows_teacher(tokenizer, tiny_model, teacher_dirs):
    """distill_loss=full: the extra loss is opd_coef · the token mean of the exact reverse KL to each row's own
    teacher; the advantages keep only the outcome term (none here)."""
    teachers = {"A": {"path": teacher_dirs["A"], "domains": ["math"]}, "B": {"path": teacher_dirs["B"], "domains": ["agent"]}}
    module = _module(tiny_model, teachers=teachers, distill_loss="full", opd_coef=2.0)
    batch = _batch(tokenizer, ["math", "agent", "agent"])
    module.prepare_experience(batch)
    module.compute_advantages(batch)
    assert torch.all(batch.advantages == 0)
    logits = module.scoring.forward_logits(module.policy, batch)
    scale = {"total_tokens": float(batch.loss_mask.sum()), "num_sequences": 3.0}
    loss, stats = module.extra_loss(batch, logits, None, batch.loss_mask, scale)
    models = {n: load_causal_lm(p, None).eval() for n, p in teacher_dirs.items()}
    expected = 0.0
    for i, name in enumerate(["A", "B", "B"]):
        row = batch.select([i])
        with torch.no_grad():
            t = module.scoring.forward_logits(models[name], row)
        expected = expected + full_reverse_kl(logits[i:i + 1], t, row.loss_mask).sum()
    assert loss.item() == pytest.approx(2.0 * expected.item() / scale["total_tokens"], rel=1e-5)
    assert stats["opd/full_reverse_kl"].item() == pytest.approx(expected.item() / scale["total_tokens"], rel=1e-5)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.policy.parameters())
    assert all(p.grad is None for m in models.values() for p in m.parameters())
    module.teardown("fit")


@pytest.mark.parametrize("extra,message", [
    ({"teachers": {"E": {"path": "/x", "serve": "engine"}}}, "served by an engine"),
    ({"teachers": {"E": {"engine": {"_target_": "x.Y"}}}}, "served by an engine"),
])
def test_full_distill_loss_needs_trainer_side_teachers(tiny_model, extra, message):
    with pytest.raises(ConfigError, match=message):
        _module(tiny_model, distill_loss="full", **extra)


def test_full_distill_loss_refuses_top_k(tiny_model, teacher_dirs):
    cfg = validate({"algo": {"name": "opd", "distill_loss": "full", "teachers": {"A": {"path": teacher_dirs["A"]}}}}).algo
    with pytest.raises(ConfigError, match="top_k=0"):
        OPD(cfg, tiny_model, temperature=1.0, top_k=5, max_new_tokens=4, pad_token_id=0)


# ------------------------------------------------------------------------------------------ the real loop
def _metrics(tmp_path):
    with open(glob.glob(os.path.join(str(tmp_path), "csv", "*", "metrics.csv"))[0]) as f:
        return list(csv.DictReader(f))


def test_opd_fit_builtin_teacher_with_icepop(tmp_path):
    """`algo=opd` as shipped (the built-in warm-started teacher), shrunk for a test, with IcePop."""
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "algo=opd", "rollout.n_samples_per_prompt=1", "algo.teachers.tiny150.preset=test",
        "algo.teachers.tiny150.warm_start.steps=2", "algo.teachers.tiny150.warm_start.batch_size=8",
        f"algo.teachers.tiny150.warm_start.cache_dir={tmp_path}/cache", "+callbacks.icepop._target_=glmlight.callbacks.IcePop",
        "~callbacks.held_out_eval", "~callbacks.sample_table", "trainer.checkpoint_every_n_steps=1")))
    before = {k: v.clone() for k, v in run.module.policy.state_dict().items()}
    run.fit()
    assert any(not torch.equal(before[k], v) for k, v in run.module.policy.state_dict().items())
    assert run.module.policy_version == 2
    rows = [r for r in _metrics(tmp_path) if r.get("opd/reverse_kl")]
    assert len(rows) == 2 and all(r["opd/frac/tiny150"] == "1.0" and r["icepop/popped_frac"] for r in rows)
    ckpt = torch.load(os.path.join(str(tmp_path), "checkpoints", "last.ckpt"), weights_only=False)
    assert all(k.startswith("policy.") for k in ckpt["state_dict"])  # the teacher is not checkpointed


def test_opd_fit_full_distill_loss(tmp_path, teacher_dirs):
    """The real loop with distill_loss=full: the student trains on the exact KL to its checkpoint teacher."""
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "algo=opd", "~algo.teachers.tiny150", "algo.default_teacher=null", "algo.distill_loss=full",
        f"+algo.teachers.A={{path:{teacher_dirs['A']}}}", "~callbacks.held_out_eval", "~callbacks.sample_table")))
    before = {k: v.clone() for k, v in run.module.policy.state_dict().items()}
    run.fit()
    assert any(not torch.equal(before[k], v) for k, v in run.module.policy.state_dict().items())
    rows = [r for r in _metrics(tmp_path) if r.get("opd/full_reverse_kl")]
    assert len(rows) == 2 and all(float(r["opd/full_reverse_kl"]) > 0 for r in rows)


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
