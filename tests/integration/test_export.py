"""Export: a run's policy (LoRA merged) and tokenizer as a Hugging Face checkpoint, at the end of fit and
from any Lightning checkpoint (scripts/export.py); transformers (and the real vLLM server) serve it."""

import json
import os
import socket
import subprocess
import urllib.request

import pytest
import torch
from safetensors.torch import load_file

import glmlight
from glmlight import compose
from glmlight.models.export import export_hf
from glmlight.ops.quant import FP8_DTYPE, dequantize_fp8_block
from glmlight.sample import Experience, Sample
from tests.support.waiting import running, wait_until
from tests.conftest import encode, load_script, overrides_for_tests
from tests.support.hf_models import build_tiny_hf

PROMPTS = ["3+4=", "12+7=", "9+9="]
COMPLETIONS = [[8, 9, 10, 1], [7, 12, 1], [5, 5, 5, 5, 1]]


def _batch(tokenizer):
    prompts = [encode(tokenizer, p) for p in PROMPTS]
    samples = [Sample(prompt_ids=p, response_ids=c, loss_mask=[1] * len(c), rollout_logprobs=[0.0] * len(c),
                      versions=[0] * len(c)) for p, c in zip(prompts, COMPLETIONS)]
    return prompts, Experience.collate(samples, pad_token_id=tokenizer.pad_token_id)


def _logprobs(module, model, tokenizer):
    _, exp = _batch(tokenizer)
    lp = module.scoring.compute_logprobs(model.eval(), exp)
    return [lp[i, : len(c)].tolist() for i, c in enumerate(COMPLETIONS)]


def _flat(rows):
    return [x for r in rows for x in r]


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True,
                                                dtype=torch.float32)


def _run(tmp_path, *extra):
    run = glmlight.build(compose(overrides_for_tests(tmp_path, "trainer.max_steps=2", "~callbacks.sample_table",
                                                     "~callbacks.held_out_eval", "algo.lr=5e-3", *extra)))
    run.fit()
    return run


@pytest.mark.parametrize("extra", [[], ["model.lora.rank=4"],
                                   # the model options experiment=consistency sets: every path builds the same policy
                                   ["model.n_routed_experts=16", "model.num_experts_per_tok=4", "model.index_topk=4"]])
def test_fit_exports_a_checkpoint_transformers_loads_with_the_trainers_logprobs(tmp_path, tokenizer, extra):
    run = _run(tmp_path, "trainer.checkpoint_every_n_steps=2", *extra)
    out = os.path.join(str(tmp_path), "hf")
    files = sorted(os.listdir(out))
    assert "model.safetensors" in files and "config.json" in files and "tokenizer.json" in files
    assert not any(f.endswith((".bin", ".pt", ".pth")) or "adapter" in f for f in files)
    assert not [d for d in os.listdir(str(tmp_path)) if ".tmp-" in d or ".old-" in d]
    loaded = _load(out)
    assert type(loaded).__name__ == "GlmMoeDsaForCausalLM"
    want = _logprobs(run.module, run.module.policy, tokenizer)
    assert _flat(_logprobs(run.module, loaded, tokenizer)) == pytest.approx(_flat(want), abs=1e-5)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok("12+7=")["input_ids"] == tokenizer("12+7=")["input_ids"]
    # the same checkpoint through scripts/export.py, from the run's Lightning checkpoint
    again = os.path.join(str(tmp_path), "again")
    script = load_script("export")
    assert script.main([os.path.join(str(tmp_path), "checkpoints", "last.ckpt"), again]) == 0
    a, b = load_file(os.path.join(out, "model.safetensors")), load_file(os.path.join(again, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_export_replaces_atomically_and_is_optional(tmp_path, tokenizer, tiny_model):
    out = str(tmp_path / "hf")
    os.makedirs(out)
    open(os.path.join(out, "stale.txt"), "w").close()
    export_hf(tiny_model, tokenizer, out)
    assert "stale.txt" not in os.listdir(out) and "model.safetensors" in os.listdir(out)
    assert sorted(os.listdir(str(tmp_path))) == ["hf"]
    run = _run(tmp_path / "run", "export.enabled=false", "trainer.max_steps=1")
    assert not os.path.exists(os.path.join(str(tmp_path / "run"), "hf"))
    custom = str(tmp_path / "custom")
    assert run.export(custom) == custom and os.path.isfile(os.path.join(custom, "config.json"))


def test_export_script_errors_are_one_line(tmp_path, capsys):
    script = load_script("export")
    assert script.main([str(tmp_path / "missing.ckpt"), str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_fp8_export_layout(tmp_path, tokenizer, tiny_model):
    out = export_hf(tiny_model, tokenizer, str(tmp_path / "fp8"), fp8=True)
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
    t = load_file(os.path.join(out, "model.safetensors"))
    w = tiny_model.model.layers[0].self_attn.q_b_proj.weight
    q, s = t["model.layers.0.self_attn.q_b_proj.weight"], t["model.layers.0.self_attn.q_b_proj.weight_scale_inv"]
    assert q.dtype == FP8_DTYPE and torch.allclose(dequantize_fp8_block(q, s), w, rtol=2**-4, atol=0)
    assert "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv" in t
    assert t["lm_head.weight"].dtype == torch.float32


@pytest.mark.parametrize("arch, attn", [("glm4_moe", "self_attn.q_proj"), ("glm4_moe_lite", "self_attn.q_b_proj")])
def test_fp8_export_of_the_glm4_moe_models(tmp_path, tokenizer, arch, attn):
    """GLM-4.5's and GLM-4.7-Flash's exports in the block-FP8 layout: attention, dense and expert weights
    quantised with their scales; the router, its correction bias, the norms and the head kept."""
    from tests.support.hf_models import tiny_hf_model

    model = tiny_hf_model(arch)
    out = export_hf(model, tokenizer, str(tmp_path / arch), fp8=True)
    assert json.load(open(os.path.join(out, "config.json")))["quantization_config"]["weight_block_size"] == [128, 128]
    t = load_file(os.path.join(out, "model.safetensors"))
    for name in (f"model.layers.0.{attn}.weight", "model.layers.0.mlp.gate_proj.weight",
                 "model.layers.1.mlp.shared_experts.down_proj.weight"):
        w = model.get_parameter(name)
        assert t[name].dtype == FP8_DTYPE, name
        scale = t[name + "_scale_inv"]
        # e4m3: half a unit in the last of 3 mantissa bits (2^-4 relative), or in its subnormals (2^-10 x the scale)
        assert torch.allclose(dequantize_fp8_block(t[name], scale), w, rtol=2**-4, atol=float(scale.max()) * 2**-10), name
    assert any(k.startswith("model.layers.1.mlp.experts.") and k.endswith("_scale_inv") for k in t)
    for kept in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias", "lm_head.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert t[kept].dtype == torch.float32, kept


# ----------------------------------------------------------------- the real vLLM server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url, body, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("GLMLIGHT_VLLM_PYTHON"),
                    reason="set GLMLIGHT_VLLM_PYTHON to the Python of an environment with vLLM to run the real server")
def test_real_vllm_serves_an_exported_llama_with_the_trainers_scores(tmp_path, tokenizer):
    """Train a tiny Llama two steps, export it, start `vllm serve` on the export (CPU, float32) and score a
    fixed batch with prompt_logprobs: the server's log-probs are the trainer's."""
    path = build_tiny_hf("llama", str(tmp_path / "models"))
    run = _run(tmp_path / "run", "model=hf", f"model.path={path}", "model.dtype=float32")
    out = os.path.join(str(tmp_path / "run"), "hf")
    want = _logprobs(run.module, run.module.policy, tokenizer)
    port = _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    log_path = tmp_path / "vllm.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([os.environ["GLMLIGHT_VLLM_PYTHON"], "-m", "vllm.entrypoints.openai.api_server",
                                 "--model", out, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                                 "--enforce-eager", "--max-model-len", "512", "--seed", "0"],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(healthy, alive=running(proc), poll_s=1.0, what=f"vLLM's /health ({log_path})")
        prompts, _ = _batch(tokenizer)
        for p, c, w in zip(prompts, COMPLETIONS, want):
            ids = p + c
            body = _post(url + "/v1/completions", {"model": out, "prompt": ids, "max_tokens": 1, "temperature": 1.0,
                                                   "prompt_logprobs": 0})
            entries = body["choices"][0]["prompt_logprobs"]
            served = [float(entries[i][str(t)]["logprob"]) for i, t in enumerate(ids) if i >= len(p)]
            assert served == pytest.approx(w, abs=1e-4)
    finally:
        os.killpg(proc.pid, 15)
        proc.wait()


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_files_are_readable_as_the_users_other_files(tmp_path, tokenizer, tiny_model, umask):
    """Every exported file and folder has the mode any file the user writes gets (0666 / 0777 less the umask),
    model.safetensors included (transformers writes it through a private temporary file)."""
    previous = os.umask(umask)
    try:
        out = export_hf(tiny_model, tokenizer, str(tmp_path / "hf"))
    finally:
        os.umask(previous)
    modes = {name: oct(os.stat(os.path.join(out, name)).st_mode & 0o777) for name in os.listdir(out)}
    assert "model.safetensors" in modes and set(modes.values()) == {oct(0o666 & ~umask)}, modes
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o777 & ~umask)
