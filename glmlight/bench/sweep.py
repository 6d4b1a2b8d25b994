"""--sweep: glmlight's GRPO step (sync) and TRL's at its fastest across completion length, group size
and model size, one axis at a time around the default point; prints step times and the ratio."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from glmlight.bench.common import Sizes
from glmlight.bench.grpo import run_grpo

# one axis at a time around the default point (tiny preset, 4 prompts x 8, 128 tokens)
AXES: dict[str, tuple[Any, ...]] = {"completion": (64, 256, 1024), "group": (4, 32), "preset": ("small",)}
QUICK_AXES: dict[str, tuple[Any, ...]] = {"completion": (16, 64), "group": (2, 8), "preset": ("test",)}


def sweep_points(base: Sizes, axes: dict[str, tuple[Any, ...]]) -> list[tuple[str, Sizes]]:
    points = [("default", base)]
    for axis, values in axes.items():
        points += [(f"{axis}={v}", dataclasses.replace(base, **{axis: v})) for v in values if getattr(base, axis) != v]
    return points


def bench_sweep(base: Sizes, device: str, axes: dict[str, tuple[Any, ...]], rounds: int = 1,
                trl_threads: tuple[int, ...] = (1,), steps: int = 2) -> list[dict[str, Any]]:
    """Each point: one glmlight run and one TRL run per thread count (`steps` timed steps each)."""
    out = []
    for label, s in sweep_points(dataclasses.replace(base, steps=min(base.steps, steps)), axes):
        times, _ = run_grpo(s, device, rounds, ("sync",), trl_threads)
        step = {k: statistics.median(v) for k, v in times.items()}
        trl = min((k for k in step if k.startswith("trl@")), key=step.get)
        out.append({"point": label, "preset": s.preset, "group": s.group, "prompts": s.prompts,
                    "completion": s.completion, "glmlight_s": step["sync"], "trl_s": step[trl],
                    "trl_threads": int(trl.split("@")[1]), "ratio": step[trl] / step["sync"]})
        print(f"sweep {label}: glmlight {step['sync']:.2f} s, TRL {step[trl]:.2f} s, "
              f"ratio {step[trl] / step['sync']:.2f}", flush=True)
    return out


def print_sweep(points: list[dict[str, Any]]) -> None:
    print(f"\n{'point':<16} {'preset':>7} {'group':>5} {'tokens':>6} {'glmlight s':>10} {'TRL s':>8} {'ratio':>6}")
    for p in points:
        print(f"{p['point']:<16} {p['preset']:>7} {p['group']:>5} {p['completion']:>6} {p['glmlight_s']:>10.2f} "
              f"{p['trl_s']:>8.2f} {p['ratio']:>6.2f}")
