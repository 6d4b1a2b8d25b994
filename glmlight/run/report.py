"""The run report: `report.png` (the curves an RL user looks at first) and `summary.json` (the final
figures), written into the run directory at the end of fit (`logger.report`) and by
`python scripts/report.py runs/<name>`.

Both are read from the run's own `metrics.jsonl`, which `glmlight.metrics.log_metrics` (the one
route of every metric) writes whatever the logger is (W&B offline, CSV or none): one JSON object
per call, with its RL step. A resumed run appends to the file; the last value logged for an RL step
and key wins, so the report of a resumed run is that of the uninterrupted one. A line cut short by a
kill is skipped and counted (`summary["skipped_lines"]`).

The panels: reward, held-out evaluation (pass@1, pass@k, maj@k, greedy, every set), response
length, entropy, KL (reference KL, mismatch KL, OPD reverse KL), staleness and drops, time per step
(rollout, waiting for the batch, training, weight sync, evaluation), the optimiser (gradient norm,
clip fraction, loss) and the algorithm's own (critic, distillation, compaction). A panel with nothing
logged says so. The PNG needs matplotlib (`pip install matplotlib`); without it only
summary.json is written, with a warning.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from typing import Any

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"

# (title, [(key or regex, label)], y-label); a regex (starting with ^) matches every key it fits; a label
# ending in " >" is drawn against a second y-axis on the right (another scale).
PANELS: list[tuple[str, list[tuple[str, str]], str]] = [
    ("Reward (training rollouts)", [("rollout/reward_mean", "reward mean"), ("rollout/pass_rate", "pass rate")], ""),
    ("Held-out evaluation", [(r"^eval/([^/]+)/(pass@\d+|maj@\d+|greedy/pass_rate)$", "")], "fraction of prompts"),
    ("Response length", [("rollout/response_length", "rollout"), (r"^eval/([^/]+)/response_length$", "eval")],
     "tokens"),
    ("Entropy", [("train/entropy", "policy entropy")], "nats / token"),
    ("KL", [("train/kl", "KL to reference"), ("mismatch/mismatch_kl", "mismatch KL (rollout vs train)"),
            ("mismatch/k3_kl", "mismatch k3 KL"), ("opd/reverse_kl", "reverse KL to teacher")], "nats / token"),
    ("Staleness and drops", [("rollout/staleness_max", "staleness max"), ("rollout/staleness_mean", "staleness mean"),
                             (r"^rollout/dropped/(.+)$", "dropped")], "versions / samples"),
    ("Time per RL step", [("rollout/seconds", "rollout (generation)"), ("rollout/wait_seconds", "waiting for batch"),
                          ("train/seconds", "train"), ("sync/seconds", "weight sync"), ("eval/seconds", "evaluation")],
     "seconds"),
    ("Optimiser", [("train/grad_norm", "grad norm"), ("train/clip_frac", "clip fraction >"),
                   ("train/dis_masked_frac", "DIS masked fraction >"), ("train/loss", "loss >")], "grad norm"),
    ("Algorithm", [("critic/value_loss", "critic value loss"), ("critic/explained_variance", "explained variance"),
                   ("opd/advantage_abs_mean", "OPD |advantage|"), ("rollout/compactions", "compactions"),
                   ("train/segments", "segments"), ("train/advantage_abs_mean", "|advantage|")], ""),
]


HINTS = {"KL": "\n(algo.kl_coef > 0 for a reference KL;\ncallbacks.mismatch for the mismatch KL)",
         "Held-out evaluation": "\n(callbacks.held_out_eval, eval.every_n_steps)"}


def read_metrics(run_dir: str) -> tuple[dict[int, dict[str, float | None]], int]:
    """{rl_step: {key: value}} from `<run_dir>/metrics.jsonl` (later lines win) and the number of
    lines skipped as unreadable."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist (a glmlight run writes it through glmlight.metrics)")
    rows: dict[int, dict[str, float | None]] = {}
    skipped = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
                step = int(row.pop("rl_step"))
            except (ValueError, KeyError, TypeError, AttributeError):
                skipped += 1
                continue
            row.pop("step", None)
            rows.setdefault(step, {}).update(row)
    return dict(sorted(rows.items())), skipped


def series(rows: dict[int, dict[str, float | None]], key: str) -> tuple[list[int], list[float]]:
    """(RL steps, values) of one key, non-finite values left out."""
    xs, ys = [], []
    for step, row in rows.items():
        v = row.get(key)
        if v is not None and math.isfinite(v):
            xs.append(step)
            ys.append(v)
    return xs, ys


def summarize(rows: dict[int, dict[str, float | None]], skipped: int = 0) -> dict[str, Any]:
    """The final figures: per key its last value (and step), first value (and step), min and max."""
    keys = sorted({k for row in rows.values() for k in row})
    metrics = {}
    for k in keys:
        xs, ys = series(rows, k)
        if xs:
            metrics[k] = {"last": ys[-1], "last_rl_step": xs[-1], "first": ys[0], "first_rl_step": xs[0],
                          "min": min(ys), "max": max(ys)}
    totals = {name: sum(series(rows, key)[1]) for name, key in
              (("rollout_seconds", "rollout/seconds"), ("train_seconds", "train/seconds"),
               ("eval_seconds", "eval/seconds"), ("sync_seconds", "sync/seconds"))}
    totals.update({f"dropped/{k.split('rollout/dropped/', 1)[1]}": sum(series(rows, k)[1])
                   for k in keys if k.startswith("rollout/dropped/")})
    return {"rl_steps": max(rows) if rows else 0, "skipped_lines": skipped, "totals": totals, "metrics": metrics}


def write_report(run_dir: str, title: str | None = None) -> dict[str, str]:
    """Write `summary.json` and (with matplotlib) `report.png` into `run_dir`; returns their paths."""
    rows, skipped = read_metrics(run_dir)
    summary = summarize(rows, skipped)
    out = {"summary": os.path.join(run_dir, "summary.json")}
    with open(out["summary"], "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log.warning("report.png not written: it needs matplotlib (pip install matplotlib)")
        return out
    out["report"] = os.path.join(run_dir, "report.png")
    draw(rows, out["report"], title or os.path.basename(os.path.normpath(run_dir)))
    return out


def _matches(rows: dict[int, dict[str, Any]], pattern: str, label: str) -> list[tuple[str, str]]:
    """(key, legend label) for a plain key that was logged, or every key a ^regex matches."""
    keys = sorted({k for row in rows.values() for k in row})
    if not pattern.startswith("^"):
        return [(pattern, label)] if pattern in keys else []
    rx = re.compile(pattern)
    out = []
    for k in keys:
        m = rx.match(k)
        if m:
            out.append((k, " ".join(([label] if label else []) + list(m.groups()))))
    return out


def draw(rows: dict[int, dict[str, Any]], path: str, title: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: the caller's backend and figures stay as they are
    from matplotlib.ticker import MaxNLocator

    ncols = 3
    nrows = math.ceil(len(PANELS) / ncols)
    fig = Figure(figsize=(5.2 * ncols, 3.4 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax, (name, specs, ylabel) in zip(axes.flat, PANELS):
        drawn, right, handles = 0, None, []
        for pattern, label in specs:
            for key, legend in _matches(rows, pattern, label):
                xs, ys = series(rows, key)
                if not xs:
                    continue
                target = ax
                if legend.endswith(" >"):
                    right = right or ax.twinx()
                    target, legend = right, legend[:-2] + " (right)"
                style = ("-", "--", "-.", ":")[drawn % 4]
                handles += target.plot(xs, ys, style, color=f"C{drawn % 10}", marker="o" if len(xs) <= 25 else None,
                                       markersize=3, linewidth=1.2, label=legend.replace("greedy/pass_rate", "greedy"))
                drawn += 1
        if right is not None:
            right.tick_params(labelsize=7)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("RL step", fontsize=8)
        if ylabel:
            ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(handles=handles, fontsize=6.5, loc="best")
        else:
            ax.text(0.5, 0.5, "nothing logged" + HINTS.get(name, ""), ha="center", va="center", fontsize=8,
                    transform=ax.transAxes, color="gray")
    for ax in list(axes.flat)[len(PANELS):]:
        ax.axis("off")
    fig.suptitle(f"glmlight run: {title}  ({max(rows) if rows else 0} RL steps)", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


COMPARE_KEYS = ("eval/heldout/pass@1", "eval/heldout/greedy/pass_rate", "rollout/reward_mean")


def draw_comparison(run_dirs: list[str], path: str, keys: tuple[str, ...] = COMPARE_KEYS,
                    labels: list[str] | None = None) -> None:
    """One panel per metric, one curve per run (e.g. the same recipe on two engines); a metric no run
    logged is an error that names it, a run without it is left out of that panel."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    labels = labels or [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs")
    runs = [read_metrics(d)[0] for d in run_dirs]
    fig = Figure(figsize=(5.2 * len(keys), 3.6))
    for ax, key in zip(fig.subplots(1, len(keys), squeeze=False).flat, keys):
        drawn = 0
        for i, (rows, label) in enumerate(zip(runs, labels)):
            xs, ys = series(rows, key)
            if xs:
                ax.plot(xs, ys, ("-", "--", "-.", ":")[i % 4], color=f"C{i % 10}", marker="o" if len(xs) <= 25 else None,
                        markersize=3, linewidth=1.2, label=label)
                drawn += 1
        if not drawn:
            raise ValueError(f"no run in {run_dirs} logged {key!r}")
        ax.set_title(key.replace("greedy/pass_rate", "greedy"), fontsize=10)
        ax.set_xlabel("RL step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
