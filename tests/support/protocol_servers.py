"""Loopback stand-ins for SGLang and vLLM servers, backed by the embedded `LocalEngine`, and the
helpers the client tests share.

The stand-ins (tests/support/standin_sglang.py: SGLang 0.5.23; tests/support/standin_vllm.py: vLLM 0.33.0 and
0.32.0; base and fault injection in tests/support/standin_base.py) behave as the real servers do, as read
from their sources (each docstring cites package, version and file), so the real clients can be
tested where no GPU server can run. vLLM itself also runs here for real (its CPU build, in its own
virtual environment): tests/integration/servers/test_real_servers.py.

`python <script> --port P ...` calling `serve_main("sglang" | "vllm", argv)` runs one as a
stand-in executable for the managed-launch tests; like the real servers it starts a child process
of its own (their engine cores and schedulers), which only a process-group stop reaches.
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

import pytest
import torch

from glmlight.engines.base import SamplingParams
from glmlight.engines.local.engine import LocalEngine
from tests.support.standin_base import Fault, ProtocolServer, Recorded, join_gloo_group, receive  # noqa: F401
from tests.support.standin_sglang import SGLangServer  # noqa: F401
from tests.support.standin_vllm import StandInWorker, VLLMServer  # noqa: F401


def serve_main(kind: str, argv: list[str]) -> None:
    """Run a stand-in server until SIGTERM (used as a fake `sglang.launch_server` / vLLM server)."""
    from glmlight.models.loading import load_causal_lm
    from glmlight.models.tokenizer import build_char_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--enable-return-routed-experts", action="store_true")
    ap.add_argument("--enable-return-indexer-topk", action="store_true")  # SGLang only
    args, _ = ap.parse_known_args(argv)
    import os
    import subprocess
    import sys

    # Like the real servers (vLLM's engine core and workers, SGLang's schedulers): a child process
    # that outlives us unless whoever started us stops our whole process group.
    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    tok = build_char_tokenizer()
    engine = LocalEngine(load_causal_lm(None, tok, preset="test", seed=0))
    replay = {"routed_experts": args.enable_return_routed_experts}
    if kind == "sglang":
        replay.update(indexer_topk=args.enable_return_indexer_topk,
                      fuse_topk=os.environ.get("SGLANG_DSA_FUSE_TOPK", "1") != "0")
    cls = SGLangServer if kind == "sglang" else VLLMServer
    server = cls(engine, api_key=args.api_key, port=args.port, **replay).start()
    if kind == "sglang":
        def die() -> None:  # SGLang's kill_process_tree(os.getpid()): its children, then itself with SIGKILL
            for child in (core, server._decoder):
                if child is not None:
                    child.kill()
            os.kill(os.getpid(), signal.SIGKILL)

        server.on_death = die
    print(f"stand-in {kind} server ready on {server.url}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    done.wait()
    server.close()
    core.terminate()


# ---------------------------------------------------------------------- test helpers
# ---------------------------------------------------------------- shared by the client tests
@pytest.fixture(scope="module")
def model() -> Any:
    """The test-size GLM-5 that backs every protocol server and the reference engine."""
    from glmlight.models.loading import load_causal_lm
    from glmlight.models.tokenizer import build_char_tokenizer

    return load_causal_lm(None, build_char_tokenizer(), preset="test", seed=0).eval()


@pytest.fixture(scope="module")
def ref(model: Any) -> Any:
    """An embedded engine on the same weights: what a server's answers must equal."""
    engine = LocalEngine(model)
    yield engine
    engine.close()


def greedy(tokenizer: Any, n: int = 5) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=[tokenizer.eos_token_id])


def expected(ref: Any, ps: list[list[int]], sp: SamplingParams) -> list:
    """What the embedded engine answers to each prompt on its own."""
    return [ref.generate([p], sp)[0] for p in ps]


def perturbed(model: Any, scale: float = 0.05, seed: int = 0) -> list:
    """The model's weights plus seeded noise: an update whose answers differ from the model's."""
    g = torch.Generator().manual_seed(seed)
    return [(k, v + scale * torch.randn(v.shape, generator=g)) for k, v in model.state_dict().items()]


def answers_of(model: Any, named: list, ps: list[list[int]], sp: SamplingParams) -> list:
    """What the embedded engine answers with `named` loaded: the reference for a server after an update."""
    engine = LocalEngine(model)
    engine.update_weights(named, version=1)
    try:
        return expected(engine, ps, sp)
    finally:
        engine.close()


_TOLERANCE: list[float] = []


def served_tolerance() -> float:
    """How far a stand-in server's log-probs may be from the reference engine's: both run the test-size GLM
    on the same weights in other batches (float32 rounding, tests/support/tolerances.py). The logits'
    magnitude is measured on the client tests' prompts (`prompts`: 6 tokens) for the weights whose answers
    they compare (the model and its `perturbed` copies at the default scale), the context bounded by 64 (no
    compared answer is longer than 40 tokens), at the lowest temperature they sample at (0.8: the logits
    divided by it). Computed once: ~2e-5."""
    if not _TOLERANCE:
        from glmlight.models.loading import load_causal_lm
        from glmlight.models.tokenizer import build_char_tokenizer
        from tests.support.tolerances import model_logprob_tolerance

        tok = build_char_tokenizer()
        base = load_causal_lm(None, tok, preset="test", seed=0).eval()
        tols = []
        for scale in (0.0, 0.05):
            m = load_causal_lm(None, tok, preset="test", seed=0).eval()
            if scale:
                m.load_state_dict(dict(perturbed(base, scale=scale)))
            tols.append(model_logprob_tolerance(m, prompts(tok, 4), context=64, temperature=0.8))
        _TOLERANCE.append(max(tols))
    return _TOLERANCE[0]


def assert_same(got: list, want: list, served: list | None = None) -> None:
    """Token ids and finish reasons equal; log-probs equal up to float32 rounding (served_tolerance: the
    embedded engine itself moves the last bit between calls: vectorised sums depend on memory alignment,
    and a server batches requests otherwise). With
    `served` (per request, every answer the server computed for it), the log-probs must be
    exactly one of those: nothing is lost in transport."""
    import pytest

    ids, want_ids = [g.token_ids for g in got], [w.token_ids for w in want]
    assert ids == want_ids, f"token ids {ids} != {want_ids}"
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    tol = served_tolerance()
    assert [x for g in got for x in g.logprobs] == pytest.approx([x for w in want for x in w.logprobs], abs=tol)
    if served is not None:
        for i, (g, answers) in enumerate(zip(got, served)):
            assert g.logprobs in [a.logprobs for a in answers], f"answer {i}: {g.logprobs} not among {answers}"


def prompts(tokenizer: Any, n: int) -> list[list[int]]:
    from glmlight.models.tokenizer import encode_chat

    return [encode_chat(tokenizer, [{"role": "user", "content": f"{i}+{i % 3}="}]) for i in range(n)]


def standin_script(tmp_path: Any, kind: str, *, exit_code: int | None = None, message: str = "") -> str:
    """A stand-in server executable: serves `kind` on --port, or prints `message` and exits."""
    import os

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(str(tmp_path), f"fake_{kind}_server.py")
    body = (f"import sys\nprint({message!r}, flush=True)\nsys.exit({exit_code})\n" if exit_code is not None else
            f"import sys\nsys.path.insert(0, {repo!r})\nfrom tests.support.protocol_servers import serve_main\n"
            f"serve_main({kind!r}, sys.argv[1:])\n")
    with open(path, "w") as f:
        f.write(body)
    return path


def launch_config(tmp_path: Any, backend: str, command: list[str], **server: Any) -> Any:
    """The validated config for a managed launch, plus the `launch_command` override (a key
    ServerConfig does not have; the engines read it with getattr)."""
    from omegaconf import OmegaConf

    from glmlight.config.schema import validate

    srv = {"launch": True, "launch_timeout_s": 900, "request_timeout_s": 120, "request_retries": 2,
           "request_retry_backoff_s": 0.05, "weight_sync_dir": str(tmp_path / "weights"), "model_path": str(tmp_path), **server}
    cfg = validate({"rollout": {"backend": backend, "server": srv}, "trainer": {"default_root_dir": str(tmp_path)}})
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["rollout"]["server"]["launch_command"] = command
    return OmegaConf.create(plain)
