"""Defaults that fit the model, in runs: model=hf loads a checkpoint in its own dtype (config.json) unless
model.dtype names another, and the export keeps the dtype trained in; the tiny model's task=jsonl default earns
rewards on a math JSONL with numeric labels after a short warm start."""

import json
import os
import random

import pytest
import torch

import glmlight
from glmlight.config.compose import compose
from tests.conftest import overrides_for_tests
from tests.support.hf_models import build_tiny_hf


def _fit(tmp_path, *extra):
    run = glmlight.build(compose(overrides_for_tests(tmp_path, "trainer.max_steps=1", "~callbacks.sample_table",
                                                     "~callbacks.held_out_eval", *extra)))
    run.fit()
    return run


def _export(tmp_path):
    out = os.path.join(str(tmp_path), "hf")
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    return dtypes, config.get("dtype") or config.get("torch_dtype")


@pytest.mark.parametrize("stored, override, trained", [
    (torch.float32, None, torch.float32),
    (torch.bfloat16, None, torch.bfloat16),
    (torch.float32, "bfloat16", torch.bfloat16),
])
def test_model_hf_trains_and_exports_in_the_checkpoints_own_dtype_unless_model_dtype_says(tmp_path, stored, override,
                                                                                         trained):
    path = build_tiny_hf("llama", str(tmp_path / "models"), dtype=stored)
    extra = [f"model.dtype={override}"] if override else []
    run = _fit(tmp_path / "run", "model=hf", f"model.path={path}", *extra)
    assert {p.dtype for p in run.module.policy.parameters()} == {trained}
    name = str(trained).removeprefix("torch.")
    assert _export(tmp_path / "run") == ({{"float32": "F32", "bfloat16": "BF16"}[name]}, name)


def test_a_checkpoint_dtype_glmlight_cannot_train_in_is_one_line(tmp_path):
    from glmlight.errors import ConfigError
    from glmlight.models.loading import load_causal_lm, load_tokenizer

    path = build_tiny_hf("llama", str(tmp_path))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.pop("torch_dtype", None)
    config["dtype"] = "float8_e4m3fn"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ConfigError, match=r"^config error: model.path=.*: config.json's dtype 'float8_e4m3fn' is not "
                                          r"a dtype glmlight trains in; set model.dtype=float32 or bfloat16$"):
        load_causal_lm(path, load_tokenizer(path))
    assert load_causal_lm(path, load_tokenizer(path), dtype="float32").dtype == torch.float32


def _math_jsonl(path: str, n: int = 8) -> None:
    """GSM8K-style word problems, numeric labels (integers, decimals, thousands)."""
    rng = random.Random(0)
    rows = []
    for i in range(n):
        a, b = rng.randint(12, 99), rng.randint(3, 12)
        if i % 4 == 0:
            q, ans = f"Tom has {a} marbles and buys {b} bags of {b} marbles each. How many marbles now?", str(a + b * b)
        elif i % 4 == 1:
            q, ans = f"A pen costs {b}.25 dollars. Ana buys {a} pens. How many dollars does she pay?", f"{a * b + a / 4:g}"
        elif i % 4 == 2:
            q, ans = f"A farm ships {a} crates of {b * 125} eggs. How many eggs in all?", f"{a * b * 125:,}"
        else:
            q, ans = f"Lee reads {a} pages a day for {b} days. How many pages?", str(a * b)
        rows.append({"question": q, "answer": ans})
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


@pytest.mark.slow
def test_the_tiny_jsonl_default_earns_rewards_on_a_math_jsonl(tmp_path, monkeypatch):
    """task=jsonl on the tiny model as it comes (its reward MathVerify, its warm start, its sampling length),
    only shortened (the test-size model, an 80-step warm start, one RL step of 4 x 4 answers). Slow: five minutes
    here on 2 cores beside other jobs (load 7)."""
    pytest.importorskip("math_verify")
    import glmlight.rewards.mathverify as mathverify

    path = str(tmp_path / "math.jsonl")
    _math_jsonl(path)
    scored = []
    judge = mathverify.MathVerify.__call__
    monkeypatch.setattr(mathverify.MathVerify, "__call__", lambda self, s: scored.append(judge(self, s)) or scored[-1])
    overrides = [o for o in overrides_for_tests(tmp_path, "trainer.max_steps=1") if not o.startswith(
        ("task.reward._target_", "rollout.max_new_tokens", "model.warm_start.steps"))]
    cfg = compose([*overrides, "task=jsonl", f"task.path={path}", "task.prompt_key=question", "task.label_key=answer",
                   "model.warm_start.steps=80", f"model.warm_start.cache_dir={tmp_path}/warm", "~callbacks.held_out_eval"])
    glmlight.build(cfg).fit()
    rewards = [r for r, _ in scored]
    assert len(rewards) == 16 and max(rewards) == 1.0, [(r, i["pred"], i["gold"]) for r, i in scored]
