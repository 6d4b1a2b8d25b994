"""LoRA policies (model.lora): only the adapters train, the base is the reference, the engine gets merged weights."""

import copy
import csv
import glob
import os

import pytest
import torch

import glmlight
from glmlight import compose
from glmlight.errors import ConfigError
from glmlight.models.lora import adapted_layers, apply_lora, merged_named_tensors, plain_model
from glmlight.sample import Experience, Sample
from tests.conftest import encode, overrides_for_tests
from tests.support.tolerances import model_logit_tolerance, model_logprob_tolerance

pytest.importorskip("peft")


def _build(tmp_path, *extra):
    return glmlight.build(compose(overrides_for_tests(tmp_path, "~callbacks.sample_table", *extra)))


def _experience(tokenizer, pad_id):
    rows = [(encode(tokenizer, "3+4="), [8, 9, 10, 1]), (encode(tokenizer, "12+7="), [7, 12, 1])]
    samples = [Sample(prompt_ids=p, response_ids=r, loss_mask=[1] * len(r), rollout_logprobs=[-1.0] * len(r),
                      versions=[0] * len(r)) for p, r in rows]
    return Experience.collate(samples, pad_token_id=pad_id), rows


def _perturb_adapters(policy, seed=0):
    """Non-zero B matrices (peft initialises them to 0, where the adapted model is the base)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_trainable_parameters_are_what_the_rank_implies(tiny_model):
    linears = {name: (m.in_features, m.out_features) for name, m in tiny_model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in
               ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
    total = sum(p.numel() for p in tiny_model.parameters())
    policy = apply_lora(tiny_model, rank=4, alpha=8.0)
    assert set(adapted_layers(policy)) == set(linears)
    trainable = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in trainable)
    assert sum(p.numel() for p in trainable.values()) == sum(4 * (i + o) for i, o in linears.values())
    assert sum(p.numel() for p in policy.parameters()) == total + sum(4 * (i + o) for i, o in linears.values())
    # routed experts (fused parameters), routers, the DSA indexer and the LM head carry no adapters
    assert not any(".experts." in n or ".indexer." in n or "lm_head" in n or ".gate." in n for n in trainable)


def test_merged_weights_and_plain_model(tiny_model, tokenizer):
    base = copy.deepcopy(tiny_model)
    policy = apply_lora(tiny_model, rank=4, alpha=8.0)
    _perturb_adapters(policy)
    merged = dict(merged_named_tensors(policy))
    assert set(merged) == set(base.state_dict())
    layer = adapted_layers(policy)["model.layers.0.self_attn.q_a_proj"]
    expected = base.model.layers[0].self_attn.q_a_proj.weight + 2.0 * (layer.lora_B["default"].weight @
                                                                      layer.lora_A["default"].weight)
    assert torch.allclose(merged["model.layers.0.self_attn.q_a_proj.weight"], expected, atol=1e-6)
    assert torch.equal(merged["model.embed_tokens.weight"], base.model.embed_tokens.weight)
    clean = plain_model(policy)
    assert type(clean).__name__ == type(base).__name__ and not hasattr(clean, "peft_config")
    ids = torch.tensor([encode(tokenizer, "3+4=")])
    # x (W + s B A) against x W + s (x A) B: two float32 computations of the same logits
    tol = model_logit_tolerance(clean, ids.tolist())
    with torch.no_grad():
        assert torch.allclose(clean(input_ids=ids).logits, policy.eval()(input_ids=ids).logits, atol=tol, rtol=0)
    # nothing merged in place: the base weights are untouched
    assert torch.equal(layer.base_layer.weight, base.model.layers[0].self_attn.q_a_proj.weight)


def test_lora_grpo_trains_only_the_adapters_and_syncs_merged_weights(tmp_path, tokenizer):
    run = _build(tmp_path, "model.lora.rank=4", "model.lora.alpha=8", "algo.lr=5e-3", "algo.kl_coef=0.05",
                 "trainer.max_steps=3", "trainer.checkpoint_every_n_steps=1")
    policy = run.module.policy
    base_before = {n: p.clone() for n, p in policy.named_parameters() if not p.requires_grad}
    frozen_base = plain_model(policy)  # adapters are 0 at the start: the merged model is the base
    run.fit(close=False)  # the engine is scored below
    opt = run.trainer.optimizers[0]
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_opt == {id(p) for n, p in policy.named_parameters() if "lora_" in n}
    assert all(torch.equal(p, base_before[n]) for n, p in policy.named_parameters() if not p.requires_grad)
    assert any(p.abs().sum() > 0 for n, p in policy.named_parameters() if "lora_B" in n)  # the adapters trained
    assert run.module.policy_version == 3 == run.datamodule.engine.version
    exp, rows = _experience(tokenizer, tokenizer.pad_token_id)
    # the reference is the frozen base (adapters disabled), no copy of the model
    assert run.module.scoring.reference == []
    ref = run.module.scoring.reference_logprobs(exp)
    base_lp = run.module.scoring.compute_logprobs(frozen_base, exp)
    # the same computation: zero adapters merge into W + 0 = W bit for bit, and a disabled adapter runs W alone
    assert torch.equal(ref, base_lp)
    trained = run.module.scoring.compute_logprobs(policy.eval(), exp)
    assert (trained - ref).abs().max() > 1e-3  # the adapters matter
    # the engine serves the merged weights: its log-probs are the trained policy's
    served = run.datamodule.engine.score([p for p, _ in rows], [c for _, c in rows])
    tol = model_logprob_tolerance(plain_model(policy), [p + c for p, c in rows])  # merged vs adapters: float32 apart
    for i, (_, c) in enumerate(rows):
        assert served[i] == pytest.approx(trained[i, : len(c)].tolist(), abs=tol)
    run.close()
    # checkpoints hold the adapters only, and a resumed run continues from them
    ckpt = torch.load(os.path.join(str(tmp_path), "checkpoints", "last.ckpt"), weights_only=False)
    assert ckpt["state_dict"] and all("lora_" in k or not k.endswith("weight") for k in ckpt["state_dict"])
    resumed = _build(tmp_path, "model.lora.rank=4", "model.lora.alpha=8", "algo.lr=5e-3", "algo.kl_coef=0.05",
                     "trainer.max_steps=4", "trainer.resume=last", "~callbacks.held_out_eval")
    resumed.fit()
    assert resumed.module.policy_version == 4


def test_lora_checkpoint_of_other_adapters_is_refused(tmp_path):
    run = _build(tmp_path, "model.lora.rank=4", "model.lora.target_modules=[o_proj]", "trainer.max_steps=1",
                 "~callbacks.held_out_eval", "trainer.checkpoint_every_n_steps=1")
    run.fit()
    other = _build(tmp_path, "model.lora.rank=4", "trainer.max_steps=2", "trainer.resume=last",
                   "~callbacks.held_out_eval")
    with pytest.raises(Exception, match="lacks"):
        other.fit()


def test_lora_uses_the_models_own_forward(tmp_path):
    run = _build(tmp_path, "model.lora.rank=2", "trainer.max_steps=1")
    assert run.module.scoring.use_glm_forward is False
    with pytest.raises(ConfigError, match="model.lora.rank"):
        _build(tmp_path, "model.lora.rank=2", "model.forward=glmlight")
    with pytest.raises(ConfigError, match="target_modules"):
        _build(tmp_path, "model.lora.rank=2", "model.lora.target_modules=[no_such_layer]")


def test_lora_sao_trains_the_adapters_and_the_value_head(tmp_path):
    run = _build(tmp_path, "algo=sao", "model.lora.rank=4", "trainer.max_steps=2", "rollout.mode=sync",
                 "~callbacks.held_out_eval", "trainer.checkpoint_every_n_steps=2")
    critic = run.module.critic
    assert [n for n, p in critic.named_parameters()] == ["value_head.weight", "value_head.bias"]
    head = critic.value_head.weight.clone()
    run.fit()
    assert not torch.equal(head, critic.value_head.weight)
    keys = torch.load(os.path.join(str(tmp_path), "checkpoints", "last.ckpt"), weights_only=False)["state_dict"]
    assert "critic.value_head.weight" in keys
    assert not any(k.startswith("critic.backbone") for k in keys)


@pytest.mark.slow
def test_lora_grpo_learns_the_default_task(tmp_path):
    """The default run (tiny GLM-5, warm start, arithmetic exact match, its 50 steps) with LoRA rank 8:
    held-out reward rises (measured 0.102 -> 0.154 with lr 5e-3 and with 2e-3; docs/results/models.md, "LoRA")."""
    run = glmlight.build(compose([f"trainer.default_root_dir={tmp_path}", "logger=csv", "trainer.max_steps=50",
                                  "trainer.enable_progress_bar=false", "model.lora.rank=8", "algo.lr=5e-3",
                                  "eval.every_n_steps=50", "~callbacks.sample_table"]))
    run.fit()
    path = glob.glob(os.path.join(str(tmp_path), "csv", "*", "metrics.csv"))[0]
    with open(path) as f:
        evals = [float(r["eval/heldout/reward"]) for r in csv.DictReader(f) if r.get("eval/heldout/reward")]
    assert len(evals) >= 2 and evals[-1] > evals[0] + 0.03, evals


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_lora_with_a_sharded_strategy_is_one_line(strategy):
    from glmlight import compose
    from glmlight.config.schema import validate
    from glmlight.errors import ConfigError

    with pytest.raises(ConfigError, match=f"model.lora with trainer.strategy={strategy} is not supported"):
        validate(compose(["model.lora.rank=4", f"trainer.strategy={strategy}"]))


def test_replay_and_the_agreement_monitors_see_through_lora(tmp_path):
    """A LoRA policy (peft wraps the model) has the routers and DSA indexers of its base: routing and index
    replay are accepted, the policy's old log-probs replay the engine's choices, and the agreement
    monitors measure it (1.0 under replay)."""
    run = _build(tmp_path, "model.lora.rank=4", "algo.replay=both", "trainer.max_steps=1", "~callbacks.held_out_eval",
                 "model.index_topk=4", "model.n_routed_experts=16", "model.num_experts_per_tok=4",
                 "+callbacks.routing_agreement._target_=glmlight.callbacks.RoutingAgreement",
                 "+callbacks.routing_agreement.every_n_steps=1",
                 "+callbacks.index_agreement._target_=glmlight.callbacks.IndexAgreement",
                 "+callbacks.index_agreement.every_n_steps=1")
    run.fit()
    rows = list(csv.DictReader(open(glob.glob(os.path.join(tmp_path, "csv", "version_*", "metrics.csv"))[0])))
    logged = {k: float(v) for row in rows for k, v in row.items() if v not in ("", None)}
    assert logged["routing_agreement/mean"] == 1.0 and logged["index_agreement/mean"] == 1.0, logged
