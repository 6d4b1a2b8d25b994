"""server: one real vLLM server glmlight launches (tiny Llama, CPU build) against
- the raw HTTP API driven concurrently with aiohttp (glmlight's client overhead);
- glmlight's embedded engine on the same checkpoint, same prompts, exactly the same number of new
  tokens per request (the server is driven raw, its fastest; ignore_eos / no stop ids on both sides);
- weight sync: seconds per GB pushed into the server (tensor and disk modes) and into the embedded
  engine, against memcpy and disk-write bandwidth of the same bytes measured in the same run."""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from glmlight.bench.common import TARGETS, Sizes, row
from glmlight.bench.weightsync import copy_seconds, twins, write_seconds


def _time_push(push, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        push()
        out.append(time.perf_counter() - t)
    return out


async def _session(aiohttp: Any) -> Any:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


def _config(s: Sizes, ckpt: str, root: str, flags: list[str], env: dict[str, str]) -> Any:
    from glmlight.config.schema import validate

    return validate({"rollout": {"backend": "vllm", "server": {
        "launch": True, "launch_python": os.environ["GLMLIGHT_VLLM_PYTHON"], "launch_args": flags, "launch_env": env,
        "launch_timeout_s": 900, "api_key_env": None, "max_in_flight": 256,
        "weight_sync_dir": os.path.join(root, "weights")}}, "model": {"path": ckpt},
        "trainer": {"default_root_dir": root}})


def _bigger_llama(tiny: str, out: str, hidden: int, layers: int) -> str:
    """The tiny Llama checkpoint's tokenizer and config with `hidden` / `layers` (head dim 32)."""
    import transformers as T

    config = T.AutoConfig.from_pretrained(tiny)
    config.update({"hidden_size": hidden, "intermediate_size": 3 * hidden, "num_hidden_layers": layers,
                   "num_attention_heads": hidden // 32, "num_key_value_heads": hidden // 64, "head_dim": 32})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = T.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    T.AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    return out


def bench_server(s: Sizes, device: str) -> list[dict[str, Any]]:
    import aiohttp

    from glmlight.models.loading import load_causal_lm
    from glmlight.models.tokenizer import build_char_tokenizer, encode_chat
    from glmlight.engines.base import SamplingParams
    from glmlight.engines.factory import build_server_engine
    from glmlight.engines.local.engine import LocalEngine
    from glmlight.engines.servers.protocol import sampling_fields
    from glmlight.models.tiny_checkpoint import build_tiny_checkpoint

    root = tempfile.mkdtemp(prefix="glmlight-bench-server-")
    ckpt = build_tiny_checkpoint(os.path.join(root, "tiny-llama"), "llama", seed=0)
    flags = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--seed", "0",
             "--no-enable-chunked-prefill"]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1"} if device == "cpu" else {}
    cfg = _config(s, ckpt, root, flags, env)
    tok = build_char_tokenizer()
    prompts = [encode_chat(tok, [{"role": "user", "content": f"{i % 10}+{i % 7}="}], add_generation_prompt=True)
               for i in range(s.server_prompts)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=s.server_tokens, seed=1000 + i) for i in range(len(prompts))]
    policy = load_causal_lm(ckpt, tok).eval()
    local = LocalEngine(policy, device=device, pad_token_id=tok.pad_token_id)
    engine = build_server_engine(cfg)
    rows: list[dict[str, Any]] = []
    try:
        url, model = engine.urls[0], engine.served_model

        def body(p: list[int], sp: SamplingParams, exact: bool) -> dict[str, Any]:  # what glmlight's client sends
            b = {"model": model, "prompt": p, "max_tokens": sp.max_new_tokens, **sampling_fields(sp), "n": 1,
                 "stream": False, "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
                 "seed": sp.seed}
            if exact:  # exactly max_tokens new tokens, as the embedded engine without stop ids
                b.update(ignore_eos=True, min_tokens=sp.max_new_tokens)
            return b

        loop = asyncio.new_event_loop()  # one loop and one connection pool for every raw round
        session = loop.run_until_complete(_session(aiohttp))

        async def raw_round(exact: bool) -> int:
            async def one(p, sp):
                async with session.post(url + "/v1/completions", json=body(p, sp, exact)) as r:
                    return len((await r.json())["choices"][0]["token_ids"])

            return sum(await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params))))

        sides = {"client": lambda: sum(len(g.token_ids) for g in engine.generate(prompts, params)),
                 "raw": lambda: loop.run_until_complete(raw_round(False)),
                 "raw exact": lambda: loop.run_until_complete(raw_round(True)),
                 "embedded": lambda: sum(len(g.token_ids) for g in local.generate(prompts, params))}
        for fn in sides.values():
            fn()  # warm-up
        rate: dict[str, list[float]] = {k: [] for k in sides}
        counts: dict[str, int] = {}
        for _ in range(s.server_reps):  # alternating
            for name, fn in sides.items():
                t = time.perf_counter()
                counts[name] = fn()
                rate[name].append(counts[name] / (time.perf_counter() - t))
        loop.run_until_complete(session.close())
        loop.close()
        if counts["client"] != counts["raw"] or counts["embedded"] != counts["raw exact"]:
            print(f"server: token counts differ: {counts}", file=sys.stderr)
        med = {k: statistics.median(v) for k, v in rate.items()}
        version = ".".join(map(str, engine.info.versions.get(url, ()))) or "?"
        work = f"vLLM {version} (CPU build, --enforce-eager, float32), tiny Llama, {s.server_prompts} concurrent requests"
        rows.append(row("vLLM rollout through glmlight's client", "tokens/s", med["client"], med["raw"],
                        TARGETS["server"], f"{work} x <= {s.server_tokens} new tokens, same requests and seeds on "
                        "both sides; baseline: aiohttp straight to /v1/completions"))
        rows.append(row("embedded engine vs real vLLM server", "tokens/s", med["embedded"], med["raw exact"],
                        TARGETS["server_engine"], f"{work} x exactly {s.server_tokens} new tokens; embedded: "
                        "LocalEngine (generic runner, 1 decode thread); vLLM: raw concurrent HTTP, ignore_eos"))
    finally:
        engine.close()
        local.close()
    try:  # weight sync: a second server on a bigger Llama, so that a push moves ~100 MB
        big = _bigger_llama(ckpt, os.path.join(root, "llama-sync"), s.sync_hidden, s.sync_layers)
        big_policy = load_causal_lm(big, tok).eval()
        local = LocalEngine(big_policy, device=device, pad_token_id=tok.pad_token_id)
        engine = build_server_engine(_config(s, big, root, flags, env))
        try:
            rows += _sync_rows(s, engine, local, big_policy, root)
        finally:
            engine.close()
            local.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for r in rows:
        print(f"server: {r['figure']}: {r['glmlight']:.1f} vs {r['baseline']:.1f} {r['unit']}", file=sys.stderr)
    return rows


def _sync_rows(s: Sizes, engine: Any, local: Any, policy: torch.nn.Module, root: str) -> list[dict[str, Any]]:
    """GB/s of weight pushes of the tiny Llama's state into the server (tensor, disk) and the
    embedded engine, each against memcpy / disk write of the same bytes in the same run."""
    named = [(k, v.detach().clone()) for k, v in policy.state_dict().items()]
    nbytes = sum(v.numel() * v.element_size() for _, v in named)
    gb = nbytes / 1e9
    version = [engine.version]

    def push_server(mode: str) -> None:
        engine.sync.mode = mode
        version[0] += 1
        engine.update_weights(named, version=version[0])

    def push_local() -> None:
        version[0] += 1
        local.update_weights(named, version=version[0])

    times: dict[str, list[float]] = {k: [] for k in ("tensor", "disk", "embedded", "memcpy", "write")}
    scratch, dst = os.path.join(root, "write-bandwidth.bin"), twins(named)
    for mode in ("tensor", "disk"):
        push_server(mode)  # warm-up
    push_local()
    for _ in range(s.sync_reps):
        times["tensor"] += _time_push(lambda: push_server("tensor"), 1)
        times["disk"] += _time_push(lambda: push_server("disk"), 1)
        times["embedded"] += _time_push(push_local, 1)
        times["memcpy"].append(copy_seconds(named, dst))
        times["write"].append(write_seconds(named, scratch))
    med = {k: statistics.median(v) for k, v in times.items()}
    per_gb = {k: v / gb for k, v in med.items()}
    params = sum(v.numel() for _, v in named) / 1e6
    note = (f"Llama state ({params:.0f}M params), {nbytes / 1e6:.0f} MB; s/GB: server tensor {per_gb['tensor']:.2f}, server disk "
            f"{per_gb['disk']:.2f}, embedded {per_gb['embedded']:.3f}, memcpy {per_gb['memcpy']:.3f}, "
            f"disk write {per_gb['write']:.3f} (page cache, no fsync, as the disk mode)")
    return [row("weight sync into vLLM, tensor mode, vs memcpy", "GB/s", gb / med["tensor"], gb / med["memcpy"],
                None, note),
            row("weight sync into vLLM, disk mode, vs disk write", "GB/s", gb / med["disk"], gb / med["write"],
                None, note),
            row("weight sync into the embedded engine (same Llama)", "GB/s", gb / med["embedded"],
                gb / med["memcpy"], None, note)]
