"""Online MTP training in the real Trainer (model.mtp.layers, algo.mtp_loss_coef; docs/models.md): the policy's
RL gradient is the same with and without the MTP loss, the MTP layers learn on fixed data, and a GRPO run with
the embedded engine logs the MTP metrics, syncs the MTP layers into the engine and exports and checkpoints them
under the names the servers' MTP loaders read."""

from __future__ import annotations

import csv
import glob
import json
import math

import lightning.pytorch as pl
import pytest
import torch
from safetensors import safe_open

import glmlight
from glmlight import compose
from glmlight.models.tokenizer import build_char_tokenizer, encode_chat
from glmlight.sample import Sample
from tests.conftest import load_script, overrides_for_tests
from tests.support.scripts.fixed_batches import Recorder, ReplayData
from tests.support.tolerances import dims, gradient_tolerances, within


def _groups(n_prompts=3, group=4, seed=0):
    """GRPO groups of random responses; the first group's rewards are all equal (zero advantages)."""
    tok = build_char_tokenizer()
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in range(n_prompts):
        prompt = encode_chat(tok, [{"role": "user", "content": "1+" * (p + 1) + "2="}])
        for j in range(group):
            n = int(torch.randint(3, 12, (1,), generator=g))
            ids = torch.randint(5, 60, (n,), generator=g).tolist()
            out.append(Sample(prompt_ids=prompt, response_ids=ids, loss_mask=[1] * n,
                              rollout_logprobs=[-math.log(len(tok))] * n, versions=[0] * n,
                              reward=0.5 if p == 0 else float((p + j) % 3) / 2, group_id=p, rollout_id=len(out),
                              metadata={"prompt_index": p}))
    return out


def _fit(tmp_path, name, batches, *extra):
    """A run of len(batches) RL steps on these samples; (recorded gradients and parameters, logged rows)."""
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path / name, f"trainer.max_steps={len(batches)}", "~callbacks.held_out_eval", "~callbacks.sample_table",
        "export.enabled=false", *extra)))
    run.datamodule = ReplayData(run.datamodule, [batches])
    rec = Recorder(str(tmp_path / f"{name}.pt"))
    run.trainer.callbacks.append(rec)
    with run:
        run.fit()
    rows = list(csv.DictReader(open(glob.glob(str(tmp_path / name / "**" / "metrics.csv"), recursive=True)[0])))
    return torch.load(tmp_path / f"{name}.pt"), rows


@pytest.mark.parametrize("forward", ["glmlight", "transformers"])
def test_the_policy_gradient_is_the_same_with_and_without_the_mtp_loss(tmp_path, forward):
    """One GRPO step on fixed samples (one group with equal rewards, whose rows the update skips without an MTP
    loss): the policy's gradients with algo.mtp_loss_coef=0.2 are those without MTP layers, to float32 rounding
    (measured: 1.2e-10 apart, the largest entry 1.6e-3), after clipping (the policy and the MTP layers each by
    their own norm)."""
    samples = _groups()
    clip = 0.02  # below the policy's gradient norm: clipping is on
    on, rows = _fit(tmp_path, "mtp", [samples], "model.mtp.layers=1", "algo.mtp_loss_coef=0.2", f"algo.grad_clip={clip}",
                    f"model.forward={forward}")
    off, _ = _fit(tmp_path, "off", [samples], "model.mtp.layers=0", f"algo.grad_clip={clip}", f"model.forward={forward}")
    g_on, g_off = on["grads"][0], off["grads"][0]
    mtp = {k: v for k, v in g_on.items() if k.startswith("policy.mtp.")}
    assert mtp and set(g_on) - set(mtp) == set(g_off)
    # the MTP layers get gradient (the DSA indexer none, as in the main model)
    assert all(float(v.abs().max()) > 0 for k, v in mtp.items() if ".indexer." not in k)
    norm = lambda gs: math.sqrt(sum(float(v.square().sum()) for v in gs.values()))  # noqa: E731
    assert abs(norm(g_off) - clip) < 1e-6 and abs(norm(mtp) - clip) < 1e-6  # both clipped, each to its own norm
    logged = [r for r in rows if r.get("train/grad_norm")][0]
    assert float(logged["train/grad_norm"]) > clip and float(logged["train/mtp_grad_norm"]) > clip
    # the policy's gradients: the same sums, the main model's last layer run on more positions (float32 rounding)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    from glmlight.models.tiny import tiny_glm5_config

    cfg = tiny_glm5_config(len(build_char_tokenizer()), "test")
    bound = gradient_tolerances(g_off, **dims(cfg), context=max(lengths), tokens=sum(lengths))
    policy = {k: g_on[k] for k in g_off}
    assert within(policy, g_off, bound) == []


def test_the_mtp_loss_falls_on_fixed_data(tmp_path):
    samples = _groups(seed=1)
    _, rows = _fit(tmp_path, "learn", [samples] * 6, "model.mtp.layers=2", "algo.mtp_loss_coef=0.2", "algo.lr=2e-3")
    logged = [r for r in rows if r.get("train/mtp_loss")]
    losses = [float(r["train/mtp_loss"]) for r in logged]
    accuracy = [float(r["train/mtp_accuracy@1"]) for r in logged]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    # measured here: 4.654, 4.531, 4.412, 4.312, 4.210, 4.116; depth 1's accuracy 0.010 -> 0.347
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.3, losses
    assert accuracy[-1] > accuracy[0] + 0.1, accuracy
    assert all(0 <= float(r[f"train/mtp_accuracy@{d}"]) <= 1 for r in logged for d in (1, 2))


def test_grpo_with_mtp_logs_syncs_checkpoints_and_exports_the_mtp_layers(tmp_path):
    root = tmp_path / "run"
    run = glmlight.build(compose(overrides_for_tests(
        root, "model.mtp.layers=1", "algo.mtp_loss_coef=0.2", "trainer.max_steps=3", "trainer.checkpoint_every_n_steps=3")))
    gaps = []

    class EngineMtp(pl.Callback):  # after WeightSync's push: the engine holds the MTP layers the trainer has
        def on_train_batch_end(self, trainer, module, *args):
            engine = trainer.datamodule.engine.model.state_dict()
            gaps.append([float((engine[k] - v).abs().max()) for k, v in module.policy.state_dict().items()
                         if k.startswith("mtp.")])

    run.trainer.callbacks.append(EngineMtp())
    with run:
        run.fit()
        trained = {k: v.detach().clone() for k, v in run.module.policy.mtp.state_dict().items()}
    assert len(gaps) == 3 and all(g and max(g) == 0 for g in gaps)
    rows = list(csv.DictReader(open(glob.glob(str(root / "**" / "metrics.csv"), recursive=True)[0])))
    steps = [r for r in rows if r.get("train/mtp_loss")]
    assert len(steps) == 3
    for r in steps:
        for key in ("train/mtp_loss", "train/mtp_accuracy@1", "train/mtp_grad_norm"):
            assert math.isfinite(float(r[key])), (key, r[key])
    # the end-of-fit export, and scripts/export.py from the run's last checkpoint, carry the trained MTP layer
    ckpt = root / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    assert torch.equal(state["policy.mtp.layers.0.eh_proj.weight"], trained["layers.0.eh_proj.weight"])
    again = tmp_path / "again"
    assert load_script("export").main([str(ckpt), str(again)]) == 0
    for hf in (root / "hf", again):
        assert json.load(open(hf / "config.json"))["num_nextn_predict_layers"] == 1
        with safe_open(str(hf / "model.safetensors"), "pt") as f:
            for name in ("eh_proj.weight", "self_attn.q_a_proj.weight", "enorm.weight", "shared_head.norm.weight"):
                assert torch.equal(f.get_tensor(f"model.layers.2.{name}"), trained[f"layers.0.{name}"]), (hf, name)
            assert torch.equal(f.get_tensor("model.layers.2.mlp.experts.1.down_proj.weight"),
                               trained["layers.0.mlp.experts.down_proj"][1])
            assert torch.equal(f.get_tensor("model.layers.2.shared_head.head.weight"), f.get_tensor("lm_head.weight"))


def test_glm45_structure_through_model_hf_trains_and_exports_a_fresh_mtp_layer(tmp_path, caplog):
    """GLM-4.5's structure (Glm4Moe, the model's own forward): a checkpoint transformers saved declares one MTP
    layer and holds none (loaded without, logged); model.mtp.layers=1 adds a fresh one, trained and exported, and
    the export loads back with it."""
    from glmlight.models.loading import load_causal_lm, load_tokenizer
    from glmlight.models.mtp import attach_mtp
    from tests.support.hf_models import build_tiny_hf

    path = build_tiny_hf("glm4_moe", str(tmp_path / "models"))
    with caplog.at_level("INFO", logger="glmlight.models.mtp"):
        assert attach_mtp(load_causal_lm(path, load_tokenizer(path)), None, path=path) == 0
    assert "declares 1 MTP layer(s) (num_nextn_predict_layers), its weights hold 0" in caplog.text
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path / "run", "model=hf", f"model.path={path}", "model.dtype=float32", "model.mtp.layers=1")))
    assert type(run.module.policy.mtp.layers[0].mlp).__name__ == "Glm4MoeMoE" and not run.module.scoring.use_glm_forward
    with run:
        run.fit()
        trained = {k: v.detach().clone() for k, v in run.module.policy.state_dict().items()}
    rows = list(csv.DictReader(open(glob.glob(str(tmp_path / "run" / "**" / "metrics.csv"), recursive=True)[0])))
    assert [math.isfinite(float(r["train/mtp_loss"])) for r in rows if r.get("train/mtp_loss")] == [True, True]
    out = str(tmp_path / "run" / "hf")
    back = load_causal_lm(out, load_tokenizer(out))
    assert attach_mtp(back, None, path=out) == 1
    assert all(torch.equal(v, trained[k]) for k, v in back.state_dict().items())


def test_grpo_with_speculative_rollout_logs_the_speculation_metrics(tmp_path):
    """rollout.speculative.depth: the embedded engine drafts with the synced MTP layer and every step logs
    rollout/spec_accept_rate, rollout/spec_tokens_per_forward and rollout/spec_enabled."""
    root = tmp_path / "run"
    run = glmlight.build(compose(overrides_for_tests(
        root, "model.mtp.layers=1", "rollout.speculative.depth=2", "rollout.speculative.auto_off=false",
        "rollout.max_new_tokens=8", "~callbacks.held_out_eval", "~callbacks.sample_table", "export.enabled=false")))
    with run:
        run.fit()
    rows = [r for r in csv.DictReader(open(glob.glob(str(root / "**" / "metrics.csv"), recursive=True)[0]))
            if r.get("rollout/spec_enabled")]
    assert len(rows) == 2
    for r in rows:
        assert 0 <= float(r["rollout/spec_accept_rate"]) <= 1 and float(r["rollout/spec_enabled"]) == 1.0
        assert 1 <= float(r["rollout/spec_tokens_per_forward"]) <= 3
