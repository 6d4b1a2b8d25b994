"""The RL step's protocol: every hook glmlight calls beyond Lightning's own, and what hooks may use.

Where each hook fires in one RL step (`glmlight/algorithms/step.py` reads the step top to bottom):

1. rollout — `RolloutDataModule.next_experience`: the engine generates and the reward scores; every
   round's samples pass through `on_rollout_samples` (the module's own first, then each callback's, in
   order) before the data module groups, pads and collates them into the step's `Experience`;
2. scoring — the policy's old log-probs (replaying the engine's recorded choices with `algo.replay`)
   and the reference's;
3. corrections and monitors — `on_experience` of each callback, in order;
4. advantages and 5. the update (the algorithm's own);
6. sync — Lightning's `on_train_batch_end`: `WeightSync` pushes the weights and, once the engine
   acknowledges them, sets `module.policy_version`.

What a hook may use, and nothing else:

- `module.policy_version` (read; written only by the weight-sync callback, on acknowledgement) and
  `module.rl_step`;
- `trainer.datamodule.engine_aside()`: the rollout engine for a trainer-side use outside the rollout
  (a probe, an evaluation), under the generation lock; `trainer.datamodule.evaluate(...)`;
- the engine's optional abilities, declared on `glmlight.engines.base.RolloutEngine`;
- `module.evaluation_targets()`: other models the algorithm wants evaluated beside the policy
  (`EvalTarget`s; OPD's teachers), which the evaluation callback runs once at the start.

A callback subclasses `RLCallback` and overrides the hooks it needs (a plain `lightning.Callback` with
methods of these names takes part the same way). A callback knows nothing of the others.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import lightning.pytorch as pl

from glmlight.sample import Experience, Sample


class RLCallback(pl.Callback):
    """Base of glmlight's callbacks: Lightning's hooks plus the RL step's own (module docstring)."""

    # False for an `on_experience` hook that does not read `batch.old_logprobs`: then the old log-probs
    # may come from the update's own forward instead of a separate one (algo.old_logprobs=auto).
    reads_old_logprobs: bool = True

    def on_rollout_samples(self, trainer: pl.Trainer, module: pl.LightningModule, samples: list[Sample],
                           counts: Counter, policy_version: int) -> list[Sample]:
        """The samples of one rollout round, before they are accepted; return those to keep.

        Args:
            trainer: the Lightning trainer.
            module: the RL module being trained.
            samples: the round's scored samples, whole groups (FAILED ones included: the data module
                drops and counts them after this hook).
            counts: this step's counters; count every sample you drop as `dropped/<reason>` (and pad or
                drop its group: `glmlight.groups.pad_or_drop_group`), so nothing is lost unseen.
            policy_version: the version of the weights training is at.
        """
        return samples

    def on_experience(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Experience) -> None:
        """The step's batch after the old and reference log-probs exist, before advantages and loss.

        Args:
            trainer: the Lightning trainer.
            module: the RL module being trained.
            batch: the collated batch; a hook may log into `batch.stats`, multiply `batch.token_weights`
                and zero `batch.loss_mask` (corrections compose: weights multiply, masks intersect).
        """


@dataclass
class EvalTarget:
    """A model an algorithm wants evaluated beside its policy (`module.evaluation_targets()`), on the
    held-out prompts `select` accepts, logged under `prefix`; `close` (if any) releases its engine."""

    prefix: str
    engine: Any  # a RolloutEngine
    select: Callable[[Any], bool] | None = None
    close: Callable[[], None] | None = None


def overrides(obj: Any, hook: str) -> bool:
    """Whether `obj` implements `hook` (a method of that name that is not RLCallback's no-op)."""
    method = getattr(type(obj), hook, None)
    return callable(method) and method is not getattr(RLCallback, hook, None)


def with_hook(objects: Iterable[Any], hook: str) -> list[Any]:
    """The objects among `objects` that implement `hook`, in order."""
    return [o for o in objects if overrides(o, hook)]


def run_rollout_sample_hooks(trainer: pl.Trainer | None, samples: list[Sample], counts: Counter,
                             policy_version: int) -> list[Sample]:
    """`on_rollout_samples` of the module (`module.on_rollout_samples(samples, counts, version)`), then of
    every callback, in order; each sees what the one before kept."""
    if trainer is None:
        return samples
    module = trainer.lightning_module
    if _module_filters(module):
        samples = module.on_rollout_samples(samples, counts, policy_version)
    for cb in with_hook(trainer.callbacks, "on_rollout_samples"):
        samples = cb.on_rollout_samples(trainer, module, samples, counts, policy_version)
    return samples


def has_rollout_sample_hooks(trainer: pl.Trainer | None) -> bool:
    """Whether anything filters rollout samples (then a round that loses samples is refilled)."""
    if trainer is None:
        return False
    return _module_filters(trainer.lightning_module) or bool(with_hook(trainer.callbacks, "on_rollout_samples"))


def _module_filters(module: Any) -> bool:
    """Whether the module's own `on_rollout_samples` takes part (it may say it has nothing to filter in
    this run: `filters_rollout_samples`, e.g. an RLModule without replay)."""
    return overrides(module, "on_rollout_samples") and bool(getattr(module, "filters_rollout_samples", True))
