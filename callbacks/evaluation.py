"""HeldOutEval: greedy answers on the task's fixed held-out prompts, at the start
of training and every N RL steps (after the weight sync, so the engine serves the
newest policy).

Besides `eval/reward` and `eval/pass_rate` (per episode: a compacted episode
counts once), agent tasks log `eval/turns_per_episode`, `eval/tool_calls_per_episode`,
`eval/truncated_frac` and the mean of every numeric environment info value
(`eval/env/<key>`); held-out sets of several domains also log each domain
(`eval/<domain>/pass_rate`, ...). With an OPD module, every teacher is evaluated
the same way once, at the start, on the held-out prompts routed to it
(`eval/teacher/<name>/pass_rate`; `eval/teacher/pass_rate` when there is one).
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from callbacks._logging import log_metrics
from glmlight.sample import Sample, Status


def episode_metrics(samples: list[Sample], prefix: str = "eval/") -> dict[str, float]:
    """Reward, pass rate and lengths of greedy episodes (segments of one episode counted once)."""
    episodes: dict[tuple[int, int], list[Sample]] = {}
    for s in samples:
        episodes.setdefault((s.group_id, s.rollout_id), []).append(s)
    scored = [parts[0] for parts in episodes.values() if parts[0].reward is not None]
    rewards = [s.reward for s in scored] or [0.0]
    out = {f"{prefix}reward": sum(rewards) / len(rewards),
           f"{prefix}pass_rate": sum(r >= 1.0 for r in rewards) / len(rewards),
           f"{prefix}response_length": sum(s.response_length for s in samples) / max(len(samples), 1)}
    agent = [parts[0] for parts in episodes.values() if "num_segments" in parts[0].metadata]
    if agent:
        n = len(agent)
        out[f"{prefix}turns_per_episode"] = sum(s.metadata["turns"] for s in agent) / n
        out[f"{prefix}tool_calls_per_episode"] = sum(s.metadata.get("env/tool_calls", 0) for s in agent) / n
        out[f"{prefix}truncated_frac"] = sum(s.status is Status.TRUNCATED for s in agent) / n
        out[f"{prefix}compactions_per_episode"] = sum(s.metadata["num_segments"] - 1 for s in agent) / n
        keys = sorted({k for s in agent for k, v in s.metadata.items()
                       if k.startswith("env/") and k != "env/tool_calls" and isinstance(v, (bool, int, float))})
        for k in keys:
            out[f"{prefix}{k}"] = sum(float(s.metadata.get(k, 0)) for s in agent) / n
    return out


def evaluate(dm: Any, engine: Any = None, prompts: list | None = None, by_domain: bool = True) -> dict[str, float]:
    """Greedy episodes of `prompts` (default: the held-out ones) through `dm`'s own rollout, served by
    `engine` (default: the data module's engine)."""
    prompts = dm.eval_prompts() if prompts is None else prompts
    if not prompts:
        return {}
    view = dm
    if engine is not None:  # the same rollout code and settings, another engine
        view = copy.copy(dm)
        view.engine = engine
    counts: Counter = Counter()
    samples = view.rollout(prompts, 1, counts, greedy=True)
    metrics = episode_metrics(samples)
    metrics["eval/reward_failed"] = float(counts["reward_failed"])
    domains = sorted({str(s.metadata.get("domain")) for s in samples})
    if by_domain and len(domains) > 1:
        for d in domains:
            metrics.update(episode_metrics([s for s in samples if str(s.metadata.get("domain")) == d],
                                           prefix=f"eval/{d}/"))
    return metrics


def teacher_metrics(dm: Any, module: Any) -> dict[str, float]:
    """Each OPD teacher, evaluated as the student is, on the held-out prompts routed to it."""
    teachers = module.teachers()
    prompts = dm.eval_prompts()
    out: dict[str, float] = {}
    for name, teacher in teachers.items():
        mine = [p for p in prompts if module.routes.get(p.domain, module.default_teacher) == name]
        if not mine:
            continue
        engine, owned = getattr(teacher, "engine", None), False
        if engine is None or not callable(getattr(engine, "generate", None)):
            from glmlight.rollout.local import LocalEngine

            engine, owned = LocalEngine(teacher.model, pad_token_id=dm.tokenizer.pad_token_id), True
        try:
            m = evaluate(dm, engine, mine, by_domain=False)
        finally:
            if owned:
                engine.close()
        out.update({f"eval/teacher/{name}/{k[len('eval/'):]}": v for k, v in m.items() if k != "eval/reward_failed"})
        if len(teachers) == 1:
            out.update({f"eval/teacher/{k[len('eval/'):]}": v for k, v in m.items() if k != "eval/reward_failed"})
    return out


class HeldOutEval(pl.Callback):
    def __init__(self, every_n_steps: int = 10, teachers: bool = True):
        self.every_n_steps = every_n_steps
        self.teachers = teachers  # OPD: evaluate each teacher once, at the start
        self.history: list[tuple[int, dict[str, float]]] = []

    def _run(self, trainer: pl.Trainer, module: pl.LightningModule, rl_step: int) -> None:
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "evaluate"):
            return
        metrics = evaluate(dm) if hasattr(dm, "rollout") and hasattr(dm, "eval_prompts") else dm.evaluate()
        if (rl_step == 0 and self.teachers and callable(getattr(module, "teachers", None))
                and hasattr(module, "routes") and hasattr(dm, "rollout")):
            metrics.update(teacher_metrics(dm, module))
        if not metrics:
            return
        self.history.append((rl_step, metrics))
        log_metrics(trainer, {**metrics, "rl_step": float(rl_step)})
        shown = {k: v for k, v in metrics.items() if k.count("/") == 1 or k.startswith("eval/teacher/")}
        rank_zero_info(f"[eval] rl_step {rl_step}: " + "  ".join(f"{k}={v:.3f}" for k, v in shown.items()))

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.every_n_steps > 0:
            self._run(trainer, module, module.rl_step)

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = module.rl_step
        if self.every_n_steps > 0 and step % self.every_n_steps == 0:
            self._run(trainer, module, step)

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [tuple(h) for h in state_dict.get("history", [])]
