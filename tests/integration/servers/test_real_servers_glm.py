"""GLM-4.5 (Glm4Moe) and GLM-4.7-Flash (Glm4MoeLite) served by the REAL vLLM and SGLang CPU servers, started by
glmlight's managed launch: a tiny checkpoint of each (glmlight/models/tiny_checkpoint.py), sampled
log-probs equal the trainer's float32 forward, and a tensor weight sync moves every answer to the new weights
and version. Slow (a server start per case); which combinations serve and the errors of those that cannot are
in docs/servers.md."""

from __future__ import annotations

import pytest

from glmlight.engines.base import SamplingParams
from glmlight.errors import EngineError
from glmlight.engines.factory import build_server_engine
from glmlight.engines.servers.launch import server_processes
from glmlight.models.tiny_checkpoint import build_tiny_checkpoint
from glmlight.engines.transport import read_checkpoint
from tests.support.real_servers import interpreter, logprob_tol, max_diff, server_config, trainer_logprobs

pytestmark = pytest.mark.slow


# vLLM serves the tiny GLM-4.7-Flash and syncs it, but its log-probs differ from the trainer's by up to ~0.5 nats
# (docs/servers.md); strict: this fails once they agree, and the docs must say so then.
VLLM_MLA_DIFFERS = pytest.mark.xfail(strict=True, reason="vLLM 0.32 CPU's GLM-4.7-Flash log-probs differ from the "
                                                         "trainer's (docs/servers.md)")


@pytest.mark.parametrize("backend, arch", [("vllm", "glm4_moe"), ("sglang", "glm4_moe"),
                                           pytest.param("vllm", "glm4_moe_lite", marks=VLLM_MLA_DIFFERS)])
def test_a_glm_moe_model_is_served_with_the_trainers_logprobs_and_synced(backend, arch, tmp_path):
    from glmlight.models.loading import load_causal_lm, load_tokenizer

    python = interpreter(backend)
    ckpts = [build_tiny_checkpoint(str(tmp_path / f"{arch}-{i}"), arch, seed=i) for i in range(2)]
    tok = load_tokenizer(ckpts[0])
    models = [load_causal_lm(p, tok).eval() for p in ckpts]
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("12+34=", "hello there")]
    tol = logprob_tol(models, prompts)
    engine = build_server_engine(server_config(backend, python, ckpts[0], str(tmp_path)))
    try:
        for i in range(2):
            if i:
                engine.update_weights(read_checkpoint(ckpts[1]), version=1)
            outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, seed=0))
            for out, prompt in zip(outs, prompts):
                assert len(out.token_ids) == 12 and set(out.versions) == {i}
                assert max_diff(out.logprobs, trainer_logprobs(models[i], prompt, out.token_ids)) <= tol
    finally:
        server_id = engine.launcher.server_id
        engine.close()
    assert server_processes(server_id) == []


def test_sglang_on_cpu_cannot_serve_glm_mla_and_says_why(tmp_path):
    """SGLang 0.5.23's torch-native attention runs MLA's prefill through its multi-head path on the latent cache;
    the managed launch reports the server's exit with that error (docs/servers.md)."""
    python = interpreter("sglang")
    ckpt = build_tiny_checkpoint(str(tmp_path / "glm4_moe_lite"), "glm4_moe_lite")
    with pytest.raises(EngineError, match=r"exited with .*RuntimeError: Expected size for first two dimensions"):
        build_server_engine(server_config("sglang", python, ckpt, str(tmp_path)))


def test_sglang_on_cpu_cannot_start_glm5_and_says_why(tmp_path):
    """SGLang 0.5.23 resolves GLM-5's DSA settings from the CUDA device's compute capability at start
    (srt/arg_groups/model_hook.py), which a CPU build of torch refuses (docs/servers.md)."""
    from glmlight.models.loading import load_causal_lm, load_tokenizer

    python = interpreter("sglang")
    tok = load_tokenizer(None)
    ckpt = str(tmp_path / "glm5")
    load_causal_lm(None, tok, preset="test").save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    with pytest.raises(EngineError, match=r"exited with .*Torch not compiled with CUDA enabled"):
        build_server_engine(server_config("sglang", python, ckpt, str(tmp_path)))
