"""Architectures besides GLM-5 through `model=hf`: dense (Llama, Qwen3: the engine's dense Llama-family runner)
and MoE (Qwen3-MoE, DeepSeek-V3: the generic runner), each built tiny and locally, trained a few GRPO steps
with the embedded engine."""

import csv
import glob
import logging
import math
import os

import pytest

import glmlight
from glmlight import compose
from glmlight.sample import Experience, Sample
from tests.conftest import encode, overrides_for_tests
from tests.support.hf_models import build_tiny_hf
from tests.support.tolerances import model_logprob_tolerance
from tests.unit.models.test_fp8 import _fp8_reference


def _metrics(root):
    with open(glob.glob(os.path.join(str(root), "csv", "*", "metrics.csv"))[0]) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("arch,extra", [
    ("llama", []),
    ("qwen3", []),
    ("qwen3_moe", []),
    ("deepseek_v3", []),
    ("llama", ["model.lora.rank=4", "algo.lr=5e-3"]),
    ("qwen3_moe", ["rollout.weight_format=fp8"]),
])
def test_hf_architecture_trains_and_syncs(tmp_path, tokenizer, caplog, arch, extra):
    path = build_tiny_hf(arch, str(tmp_path / "models"))
    root = tmp_path / "run"
    caplog.set_level(logging.INFO, logger="glmlight")
    run = glmlight.build(compose(overrides_for_tests(root, "model=hf", f"model.path={path}", "model.dtype=float32",
                                                     "trainer.max_steps=3", "~callbacks.sample_table",
                                                     "~callbacks.held_out_eval", "algo.lr=3e-3", *extra)))
    dense = arch in ("llama", "qwen3")  # the dense Llama-family runner; MoE models decode through their own forward
    assert type(run.datamodule.engine._runner).__name__ == ("DenseRunner" if dense else "HFRunner")
    assert run.module.use_glm_forward is False
    run.fit(close=False)  # the engine is scored below
    # the fast paths that do not apply are named, once each
    logs = [r.getMessage() for r in caplog.records]
    assert sum("trainer forward: the model's own" in m for m in logs) == 1
    assert sum("decodes through its own forward" in m for m in logs) == (0 if dense else 1)
    rows = _metrics(root)
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert run.module.policy_version == 3 == run.datamodule.engine.version
    # after the last sync the engine's log-probs are the trainer's
    prompts = [encode(tokenizer, "3+4="), encode(tokenizer, "12+7=")]
    completions = [[8, 9, 10, 1], [7, 12, 1]]
    samples = [Sample(prompt_ids=p, response_ids=c, loss_mask=[1] * len(c), rollout_logprobs=[0.0] * len(c),
                      versions=[0] * len(c)) for p, c in zip(prompts, completions)]
    exp = Experience.collate(samples, pad_token_id=tokenizer.pad_token_id)
    policy = run.module.policy.eval()
    if "rollout.weight_format=fp8" in extra:  # the trainer's weights through FP8 and back
        policy = _fp8_reference(policy)
    trainer_lp = run.module.compute_logprobs(policy, exp)
    served = run.datamodule.engine.score(prompts, completions)
    run.close()
    tol = model_logprob_tolerance(policy, [p + c for p, c in zip(prompts, completions)])  # float32 rounding
    for i, c in enumerate(completions):
        assert served[i] == pytest.approx(trainer_lp[i, : len(c)].tolist(), abs=tol)
    assert os.path.isfile(os.path.join(str(root), "hf", "model.safetensors"))
