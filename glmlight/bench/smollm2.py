"""smollm2: decode tokens/s on a real pretrained model, SmolLM2-135M-Instruct (`model=smollm2`, the Llama
architecture): the embedded engine's dense Llama-family runner (eager, and compile=True), its generic
runner (the model's own forward with a DynamicCache), transformers' `model.generate`, and, with
GLMLIGHT_VLLM_PYTHON and GLMLIGHT_SGLANG_PYTHON, a real vLLM and a real SGLang server on the same checkpoint,
each driven with raw concurrent HTTP. Also one GRPO step's rollout of the recipe (groups of copies of a prompt)
with the engine's shared prefill against a prefill per request.

Every side gets the same chat-formatted prompts (held-out questions of the chat_sort task) and
decodes exactly `smol_tokens` new tokens per prompt at temperature 1 (no stop tokens; the servers with
ignore_eos and a minimum of as many tokens). The embedded engine and `generate` use the process's intra-op
threads (`--threads`); the servers use their own."""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from glmlight.bench.common import TARGETS, Sizes, row, smollm2_checkpoint, timed
from glmlight.bench.serversync import BACKENDS, CPU, _config



def smollm2_prompts(tok: Any, n: int) -> list[list[int]]:
    from glmlight.data.chat_tasks import ChatQuestionTask
    from glmlight.models.tokenizer import encode_chat

    source = ChatQuestionTask("sort", seed=1)
    return [encode_chat(tok, source[i].messages) for i in range(n)]


def bench_smollm2(s: Sizes, device: str) -> list[dict[str, Any]]:
    from glmlight.models.loading import load_causal_lm, load_tokenizer
    from glmlight.engines.base import SamplingParams
    from glmlight.engines.local.engine import LocalEngine

    ckpt = smollm2_checkpoint()
    tok = load_tokenizer(ckpt)
    model = load_causal_lm(ckpt, tok).to(device).eval()
    prompts = smollm2_prompts(tok, s.smol_prompts)
    n_new = s.smol_tokens
    params = [SamplingParams(temperature=1.0, max_new_tokens=n_new, seed=1000 + i) for i in range(len(prompts))]
    threads = torch.get_num_threads()
    engines = {"dense": LocalEngine(model, device=device, runner="dense", num_threads=threads),
               "dense compiled": LocalEngine(model, device=device, runner="dense", num_threads=threads, compile=True),
               "generic": LocalEngine(model, device=device, runner="hf", num_threads=threads)}
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):], mask[i, P - len(p):] = torch.tensor(p), 1

    def hf() -> None:
        with torch.inference_mode():
            out = model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, min_new_tokens=n_new, max_new_tokens=n_new,
                                 pad_token_id=tok.pad_token_id)
        assert out.shape[1] == P + n_new

    def ours(name: str) -> None:
        gens = engines[name].generate(prompts, params)
        assert all(len(g.token_ids) == n_new for g in gens)

    warm = {}
    for name, e in engines.items():  # warm-up (the compiled engine compiles its decode step here)
        t = time.perf_counter()
        e.generate(prompts[:4], [SamplingParams(temperature=1.0, max_new_tokens=70, seed=i) for i in range(4)])
        warm[name] = time.perf_counter() - t
    servers: dict[str, _Server] = {}
    times: dict[str, list[float]] = {k: [] for k in [*engines, "generate"]}
    try:
        for backend in ("vllm", "sglang"):  # started one after the other: each takes a minute or more
            if os.environ.get(BACKENDS[backend]):
                servers[backend] = _Server(backend, ckpt, prompts, params)
                servers[backend].round(warm_up=True)
                times[backend] = []
        for _ in range(s.smol_reps):  # alternating, so that every side sees the same machine load
            for name in engines:
                times[name].append(timed(lambda: ours(name), device))
            times["generate"].append(timed(hf, device))
            for backend, server in servers.items():
                times[backend].append(server.timed_round())
    finally:
        for e in engines.values():
            e.close()
        for server in servers.values():
            server.close()
    n = len(prompts) * n_new
    rate = {k: n / statistics.median(v) for k, v in times.items() if v}
    work = (f"SmolLM2-135M-Instruct (Llama, fp32), {len(prompts)} chat prompts x exactly {n_new} new tokens, "
            f"temperature 1, {threads} intra-op thread(s)")
    rows = [row("SmolLM2 decode: embedded (dense runner) vs generate", "tokens/s", rate["dense"], rate["generate"],
                TARGETS["smollm2"], work),
            row("SmolLM2 decode: embedded, compile=True, vs generate", "tokens/s", rate["dense compiled"],
                rate["generate"], TARGETS["smollm2"],
                f"{work}; compile=True: the first generate (with the compile) took {warm['dense compiled']:.1f} s"),
            row("SmolLM2 decode: embedded, generic runner, vs generate", "tokens/s", rate["generic"],
                rate["generate"], None, work)]
    for backend, server in servers.items():
        name = {"vllm": "vLLM", "sglang": "SGLang"}[backend]
        rows.append(row(f"SmolLM2 decode: embedded (dense runner) vs real {name} server", "tokens/s", rate["dense"],
                        rate[backend], None, f"{work}; {name} {server.version} CPU build, float32, "
                        f"{' '.join(CPU[backend][0])}, {len(prompts)} concurrent requests (raw HTTP, ignore_eos)"))
        rows.append(row(f"SmolLM2 decode: embedded, compile=True, vs real {name} server", "tokens/s",
                        rate["dense compiled"], rate[backend], None, work))
    for name, r in rate.items():
        print(f"smollm2: {name}: {r:.1f} tokens/s", file=sys.stderr)
    return rows + group_rollout_rows(model, tok, s, device)


def group_rollout_rows(model: Any, tok: Any, s: Sizes, device: str) -> list[dict[str, Any]]:
    """The rollout of one step of experiment=smollm2_grpo: 4 prompts x 8 samples of exactly 32 new tokens, the
    embedded engine (dense runner) prefilling each prompt once for its group (the default) against prefilling
    all 32 requests; alternating, `smol_reps` timed rounds each after a warm-up."""
    from glmlight.engines.base import SamplingParams
    from glmlight.engines.local.engine import LocalEngine

    groups, group, n_new = (2, 4, 8) if s.smol_prompts < 32 else (4, 8, 32)
    prompts = [p for p in smollm2_prompts(tok, groups) for _ in range(group)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=n_new, seed=2000 + i) for i in range(len(prompts))]
    threads = torch.get_num_threads()
    engines = {share: LocalEngine(model, device=device, runner="dense", num_threads=threads, share_prefill=share)
               for share in (True, False)}
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for e in engines.values():
            e.generate(prompts[:2], params[:2])
        warm = engines[True].stats()["shared_prefills"]
        for _ in range(s.smol_reps):
            for share, e in engines.items():
                times[share].append(timed(lambda: e.generate(prompts, params), device))
        shared = (engines[True].stats()["shared_prefills"] - warm) // s.smol_reps
    finally:
        for e in engines.values():
            e.close()
    n = len(prompts) * n_new
    rate = {k: n / statistics.median(v) for k, v in times.items()}
    note = (f"SmolLM2-135M-Instruct, {groups} prompts x {group} samples (one GRPO step of the recipe), exactly {n_new} "
            f"new tokens, {threads} intra-op thread(s), prompts of {len(prompts[0])} tokens; {shared} requests "
            "a round shared a prefill")
    return [row("SmolLM2 GRPO rollout: shared prefill vs each request prefilled", "tokens/s", rate[True],
                rate[False], None, note)]


def _server_version(backend: str, url: str) -> str:
    """The version a server reports: vLLM's /version, SGLang's /server_info ("?" when it says none)."""
    import requests

    try:
        body = requests.get(url + ("/version" if backend == "vllm" else "/server_info"), timeout=30).json()
    except (requests.RequestException, ValueError):
        return "?"
    return str(body.get("version", "?")) if isinstance(body, dict) else "?"


class _Server:
    """A vLLM or SGLang server glmlight launches on the checkpoint (the flags of the `serversync` bench),
    driven raw: every request at once over aiohttp, to vLLM's /v1/completions or SGLang's /generate."""

    def __init__(self, backend: str, ckpt: str, prompts: list[list[int]], params: list[Any]):
        import aiohttp

        from glmlight.bench.server import _session
        from glmlight.engines.factory import build_server_engine
        from glmlight.engines.servers.protocol import sampling_fields

        self.root = tempfile.mkdtemp(prefix=f"glmlight-bench-smollm2-{backend}-")
        self.engine = build_server_engine(_config(backend, ckpt, self.root))
        url = self.engine.urls[0]
        self.version = _server_version(backend, url)
        self.loop = asyncio.new_event_loop()
        self.session = self.loop.run_until_complete(_session(aiohttp))
        if backend == "vllm":
            self.path = "/v1/completions"
            self.bodies = [{"model": self.engine.served_model, "prompt": p, "max_tokens": sp.max_new_tokens, **sampling_fields(sp),
                            "n": 1, "stream": False, "logprobs": 0, "return_token_ids": True, "seed": sp.seed,
                            "ignore_eos": True, "min_tokens": sp.max_new_tokens} for p, sp in zip(prompts, params)]
            self.count = lambda body: len(body["choices"][0]["token_ids"])
        else:
            self.path = "/generate"
            self.bodies = [{"input_ids": p, "return_logprob": True, "sampling_params": {
                "max_new_tokens": sp.max_new_tokens, "min_new_tokens": sp.max_new_tokens, "ignore_eos": True,
                "temperature": sp.temperature, "top_k": -1, "top_p": 1.0, "sampling_seed": sp.seed}}
                for p, sp in zip(prompts, params)]
            self.count = lambda body: len(body["meta_info"]["output_token_logprobs"])
        self.url, self.want = url, sum(sp.max_new_tokens for sp in params)

    def round(self, warm_up: bool = False) -> int:
        """Every request at once (a warm-up: the first two, which start the server's lazy set-up); no time
        limit, as SGLang's CPU decode with torch-native attention takes minutes for a round here."""
        import aiohttp

        async def one(body):
            async with self.session.post(self.url + self.path, json=body,
                                         timeout=aiohttp.ClientTimeout(total=None, sock_read=3600)) as r:
                return self.count(await r.json())

        async def all_():
            return sum(await asyncio.gather(*(one(b) for b in self.bodies[: 2 if warm_up else None])))

        got = self.loop.run_until_complete(all_())
        if not warm_up and got != self.want:
            print(f"smollm2: the server returned {got} tokens, {self.want} were asked for", file=sys.stderr)
        return got

    def timed_round(self) -> float:
        t = time.perf_counter()
        self.round()
        return time.perf_counter() - t

    def close(self) -> None:
        import shutil

        try:
            self.loop.run_until_complete(self.session.close())
            self.loop.close()
        finally:
            self.engine.close()
            shutil.rmtree(self.root, ignore_errors=True)
