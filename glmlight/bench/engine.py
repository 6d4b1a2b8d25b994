"""engine: decode tokens/s of LocalEngine (eager, and with compile=True) vs transformers' `model.generate`."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from glmlight.bench.common import TARGETS, Sizes, row, timed, tiny_model


def bench_engine(s: Sizes, device: str) -> list[dict[str, Any]]:
    from glmlight.engines.base import SamplingParams
    from glmlight.engines.local.engine import LocalEngine

    tok, model = tiny_model(s.preset, device)
    model.eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, len(tok), (s.batch, s.prompt), generator=g)
    engines = {"eager": LocalEngine(model, device=device), "compiled": LocalEngine(model, device=device, compile=True)}

    def hf(n: int) -> None:
        with torch.inference_mode():
            out = model.generate(ids.to(device), attention_mask=torch.ones_like(ids).to(device), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, min_new_tokens=n, max_new_tokens=n,
                                 pad_token_id=tok.pad_token_id)
        assert out.shape[1] == s.prompt + n

    def ours(name: str, n: int) -> None:
        gens = engines[name].generate(ids.tolist(), SamplingParams(temperature=1.0, max_new_tokens=n))
        assert all(len(x.token_ids) == n for x in gens)

    hf(4)  # warm-up; the compiled engine compiles its decode step here
    warm = {name: timed(lambda: ours(name, s.new_tokens), device) for name in engines}
    t_hf, t_ours = [], {name: [] for name in engines}
    for _ in range(s.reps):  # interleaved, so that all sides see the same machine load
        t_hf.append(timed(lambda: hf(s.new_tokens), device))
        for name in engines:
            t_ours[name].append(timed(lambda: ours(name, s.new_tokens), device))
    for e in engines.values():
        e.close()
    n = s.batch * s.new_tokens
    note = f"{s.preset} preset, batch {s.batch}, prompt {s.prompt}, {s.new_tokens} new tokens"
    return [row("engine decode, eager", "tokens/s", n / statistics.median(t_ours["eager"]),
                n / statistics.median(t_hf), TARGETS["engine"], note),
            row("engine decode, compile=True", "tokens/s", n / statistics.median(t_ours["compiled"]),
                n / statistics.median(t_hf), TARGETS["engine"],
                f"{note}; compile=True: the first generate (with the compile) took {warm['compiled']:.1f} s")]

