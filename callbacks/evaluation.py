"""HeldOutEval: the policy on held-out prompts at the start of training and every N RL steps (after
the weight sync, so the engine serves the newest policy): `eval.k` sampled answers per prompt and a
greedy one, on the task's held-out set and every `eval.sets` entry (`RolloutDataModule.evaluate`).

The other models an algorithm names (`module.evaluation_targets()`, glmlight.hooks) are evaluated the
same way once, at the start (RL step 0), each on the held-out prompts it selects. OPD names its
teachers: `eval/teacher/<set>/*` when there is one, `eval/teacher/<name>/<set>/*` for each of several;
the student's `eval/<set>/*` at step 0 is its start, so the two gaps (teacher − start, teacher − end)
read off one run.

Evaluation never perturbs training (its own seeds, ids and RNG: glmlight/data/evaluation.py). An
RL step's evaluation is part of the checkpoint written after that step, so a resumed run neither
repeats an evaluation the interrupted run already logged nor evaluates at a step that is not due.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from glmlight.hooks import RLCallback
from glmlight.metrics import log_metrics


class HeldOutEval(RLCallback):
    """Evaluates the policy at RL step 0 and every `every_n_steps` RL steps through the rollout engine
    (after the weight sync) and logs `eval/<set>/*` (pass@1, pass@k, maj@k, greedy pass rate, length,
    cost) with the RL step.

    Args:
        every_n_steps: the period in RL steps (0: off); None takes the run's `eval.every_n_steps`.
        teachers: also evaluate, once at the start, the models the algorithm names beside its policy
            (`module.evaluation_targets()`: OPD's teachers).
    """

    def __init__(self, every_n_steps: int | None = None, teachers: bool = True):
        self.every_n_steps = every_n_steps
        self.teachers = teachers
        self.history: list[tuple[int, dict[str, float]]] = []

    def period(self, trainer: pl.Trainer) -> int:
        if self.every_n_steps is not None:
            return self.every_n_steps
        eval_cfg = getattr(trainer.datamodule, "eval_cfg", None)
        return int(eval_cfg.every_n_steps) if eval_cfg is not None else 0

    def due(self, trainer: pl.Trainer, rl_step: int) -> bool:
        """Whether RL step `rl_step` is an evaluation step not evaluated yet (a resumed run restores
        the evaluations of the interrupted one)."""
        n = self.period(trainer)
        return n > 0 and rl_step % n == 0 and all(step != rl_step for step, _ in self.history)

    def evaluate(self, trainer: pl.Trainer, rl_step: int, engine: Any = None, sets: list[str] | None = None,
                 prefix: str = "eval", select: Any = None) -> dict[str, float]:
        """Evaluate `engine` (default: the rollout engine) on `sets` (default: all; `select` keeps only
        the prompts it accepts), log and print the metrics under `prefix` and keep them in the history."""
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "evaluate"):
            return {}
        metrics = dm.evaluate(engine=engine, sets=sets, prefix=prefix, interrupt=_on_sigterm(trainer),
                              **({"select": select} if select else {}))
        if not metrics:
            return {}
        self.history.append((rl_step, metrics))
        log_metrics(trainer, {**metrics, "rl_step": float(rl_step)})
        rank_zero_info(console_line(rl_step, metrics, prefix))
        return metrics

    def evaluate_targets(self, trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, float]:
        """The other models the algorithm wants evaluated (`module.evaluation_targets()`, glmlight.hooks:
        OPD's teachers), each on the held-out prompts it selects, through the same evaluation."""
        out: dict[str, float] = {}
        for target in module.evaluation_targets() if callable(getattr(module, "evaluation_targets", None)) else []:
            try:
                out.update(self.evaluate(trainer, 0, engine=target.engine, prefix=target.prefix, select=target.select))
            finally:
                if target.close is not None:
                    target.close()
        return out

    @override
    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.due(trainer, module.rl_step):
            self.evaluate(trainer, module.rl_step)
            if module.rl_step == 0 and self.teachers:
                self.evaluate_targets(trainer, module)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.due(trainer, module.rl_step):
            self.evaluate(trainer, module.rl_step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [tuple(h) for h in state_dict.get("history", [])]


def _on_sigterm(trainer: pl.Trainer):
    """Lightning acts on SIGTERM between training batches; an evaluation (minutes on a real model) checks
    before each of its generations and stops the run the same way."""
    def check() -> None:
        if trainer.received_sigterm:
            raise SIGTERMException
    return check


def console_line(rl_step: int, metrics: dict[str, float], prefix: str = "eval") -> str:
    """`[eval] rl_step 10: heldout pass@1=0.52 pass@8=0.83 maj@8=0.61 greedy=0.56 len=3.1 | 2.1 s 4460 tok`."""
    rest = [k[len(prefix) + 1:] for k in metrics if k.startswith(prefix + "/")]
    sets = sorted({r.split("/")[0] for r in rest if "/" in r})
    parts = []
    for name in sets:
        p = f"{prefix}/{name}/"
        shown = [(k[len(p):], v) for k, v in metrics.items() if k.startswith(p) and
                 (k[len(p):].startswith(("pass@", "maj@")) or k[len(p):] == "greedy/pass_rate")]
        text = " ".join(f"{k.replace('greedy/pass_rate', 'greedy')}={v:.3f}" for k, v in shown)
        if f"{p}response_length" in metrics:
            text += f" len={metrics[f'{p}response_length']:.1f}"
        parts.append(f"{name} {text}")
    cost = f" | {metrics.get(f'{prefix}/seconds', 0.0):.1f} s {metrics.get(f'{prefix}/tokens', 0.0):.0f} tok"
    return f"[{prefix}] rl_step {rl_step}: " + "; ".join(parts) + cost
