"""Architectures besides GLM-5 through `model=hf`: dense (Llama, Qwen3) and GLM-4.5's MoE (Glm4Moe) on the engine's
dense runner, GLM-4.7-Flash's MLA MoE (Glm4MoeLite) on its GLM-5 runner, other MoE (Qwen3-MoE, DeepSeek-V3) on the
generic runner, each built tiny and locally, trained a few GRPO steps with the embedded engine and exported."""

import csv
import glob
import logging
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

import glmlight
from glmlight import compose
from glmlight.engines.base import SamplingParams
from glmlight.sample import Experience, Sample
from tests.conftest import encode, overrides_for_tests
from tests.support.hf_models import build_tiny_hf
from tests.support.tolerances import model_logprob_tolerance
from tests.unit.models.test_fp8 import _fp8_reference


def _metrics(root):
    with open(glob.glob(os.path.join(str(root), "csv", "*", "metrics.csv"))[0]) as f:
        return list(csv.DictReader(f))


# the engine's runner of each architecture (the others: the generic one, the model's own forward)
RUNNER = {"llama": "DenseRunner", "qwen3": "DenseRunner", "glm4_moe": "DenseRunner", "glm4_moe_lite": "GlmDsaRunner"}
LORA = ["model.lora.rank=4", "algo.lr=5e-3"]
# routing replay, and the monitor of engine and trainer choosing the same experts, every step
REPLAY = ["algo.replay=routing", "+callbacks.routing_agreement._target_=glmlight.callbacks.RoutingAgreement",
          "+callbacks.routing_agreement.every_n_steps=1"]
AGREEMENT = REPLAY[1:]


CASES = {
    "llama": ("llama", []),
    "qwen3": ("qwen3", []),
    "qwen3_moe": ("qwen3_moe", []),
    "deepseek_v3": ("deepseek_v3", []),
    "glm4_moe-agreement": ("glm4_moe", AGREEMENT),
    "llama-lora": ("llama", LORA),
    "glm4_moe-lora": ("glm4_moe", LORA),
    "glm4_moe_lite-lora": ("glm4_moe_lite", LORA),
    "qwen3_moe-fp8": ("qwen3_moe", ["rollout.weight_format=fp8"]),
    "glm4_moe-fp8": ("glm4_moe", ["rollout.weight_format=fp8"]),
    "glm4_moe_lite-fp8": ("glm4_moe_lite", ["rollout.weight_format=fp8"]),
    "glm4_moe-replay": ("glm4_moe", REPLAY),
    "glm4_moe_lite-replay": ("glm4_moe_lite", REPLAY),
}


@pytest.mark.parametrize("arch,extra", list(CASES.values()), ids=list(CASES))
def test_hf_architecture_trains_and_syncs(tmp_path, tokenizer, caplog, arch, extra):
    path = build_tiny_hf(arch, str(tmp_path / "models"))
    root = tmp_path / "run"
    caplog.set_level(logging.INFO, logger="glmlight")
    run = glmlight.build(compose(overrides_for_tests(root, "model=hf", f"model.path={path}", "model.dtype=float32",
                                                     "trainer.max_steps=3", "~callbacks.sample_table",
                                                     "~callbacks.held_out_eval", "algo.lr=3e-3", *extra)))
    fast = arch in RUNNER  # a fast runner; the other models decode through their own forward
    assert type(run.datamodule.engine._runner).__name__ == RUNNER.get(arch, "HFRunner")
    assert run.module.scoring.use_glm_forward is False
    run.fit(close=False)  # the engine is scored below
    # the fast paths that do not apply are named, once each
    logs = [r.getMessage() for r in caplog.records]
    assert sum("trainer forward: the model's own" in m for m in logs) == 1
    assert sum("decodes through its own forward" in m for m in logs) == (0 if fast else 1)
    rows = _metrics(root)
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    if "+callbacks.routing_agreement.every_n_steps=1" in extra:
        # engine and trainer route every token alike: by construction under replay, and at the weights the
        # engine was synced to without it (float32 both, no near-tie on these routers)
        agreement = [float(r["routing_agreement/mean"]) for r in rows if r.get("routing_agreement/mean")]
        assert agreement == [1.0] * 3
        assert not any(r.get("rollout/dropped/no_replay_records") for r in rows)
    assert run.module.policy_version == 3 == run.datamodule.engine.version
    # after the last sync the engine samples with the trainer's log-probs (its runner), and scores as the trainer
    prompts = [encode(tokenizer, "3+4="), encode(tokenizer, "12+7=")]
    params = [SamplingParams(temperature=1.0, max_new_tokens=6, seed=i) for i in range(len(prompts))]
    gens = run.datamodule.engine.generate(prompts, params)
    completions = [g.token_ids for g in gens]
    samples = [Sample(prompt_ids=p, response_ids=c, loss_mask=[1] * len(c), rollout_logprobs=[0.0] * len(c),
                      versions=[0] * len(c)) for p, c in zip(prompts, completions)]
    exp = Experience.collate(samples, pad_token_id=tokenizer.pad_token_id)
    policy = run.module.policy.eval()
    plain_lp = run.module.scoring.compute_logprobs(policy, exp, replay=False)
    if "rollout.weight_format=fp8" in extra:  # the trainer's weights through FP8 and back
        policy = _fp8_reference(policy)
    trainer_lp = run.module.scoring.compute_logprobs(policy, exp, replay=False)
    served = run.datamodule.engine.score(prompts, completions)
    run.close()
    tol = model_logprob_tolerance(policy, [p + c for p, c in zip(prompts, completions)])  # float32 rounding
    for i, c in enumerate(completions):
        assert gens[i].logprobs == pytest.approx(trainer_lp[i, : len(c)].tolist(), abs=tol)
        assert served[i] == pytest.approx(trainer_lp[i, : len(c)].tolist(), abs=tol)
    # the export (LoRA merged) loads as the same architecture and scores as the trainer
    exported = AutoModelForCausalLM.from_pretrained(os.path.join(str(root), "hf"), local_files_only=True,
                                                    use_safetensors=True, dtype=torch.float32).eval()
    base = run.module.policy.get_base_model() if "model.lora.rank=4" in extra else run.module.policy
    assert type(exported).__name__ == type(base).__name__
    exported_lp = run.module.scoring.compute_logprobs(exported, exp, replay=False)
    for i, c in enumerate(completions):
        assert exported_lp[i, : len(c)].tolist() == pytest.approx(plain_lp[i, : len(c)].tolist(), abs=tol)
