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

`call_rl_hooks` is the one caller of both hooks, as Lightning's trainer/call.py is of its own.

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
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

import lightning.pytorch as pl

from glmlight.sample import Experience, Sample


class RLCallback(pl.Callback):
    """Base of glmlight's callbacks: Lightning's hooks plus the RL step's own (module docstring)."""

    # False for an `on_experience` hook that does not read `batch.old_logprobs`: then the old log-probs
    # may come from the update's own forward instead of a separate one (algo.old_logprobs=auto).
    reads_old_logprobs: bool = True
    # True for the callback that keeps the rollout engine's weights up to date (`SyncsWeights`).
    syncs_weights: bool = False

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


@runtime_checkable
class SyncsWeights(Protocol):
    """A callback that says whether it keeps the rollout engine's weights up to date with the policy
    (`callbacks.WeightSync`; every `RLCallback` says): build() warns when none of a run's callbacks keeps
    its embedded engine up to date."""

    syncs_weights: bool


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


# The hooks whose first argument each implementer hands on, changed or not, to the next (the samples kept).
_HANDS_ON = ("on_rollout_samples",)


def implementers(trainer: pl.Trainer | None, hook: str) -> list[Any]:
    """What takes part in `hook` of the RL step, in calling order: the module (when it implements the hook
    and says it has something to do in this run: `filters_rollout_samples`), then every callback that
    implements it."""
    if trainer is None:
        return []
    module = trainer.lightning_module
    first = [module] if overrides(module, hook) and bool(getattr(module, "filters_rollout_samples", True)) else []
    return first + with_hook(trainer.callbacks, hook)


def call_rl_hooks(trainer: pl.Trainer | None, hook: str, value: Any, *args: Any) -> Any:
    """The one caller of the RL step's hooks (as Lightning's trainer/call.py calls its callbacks' hooks):
    `hook` of every implementer, in order (`implementers`); the module's own takes `(value, *args)`, a
    callback's `(trainer, module, value, *args)`. `on_rollout_samples` returns the samples it keeps and
    each implementer sees what the one before kept; the result is what the last kept. Other hooks change
    `value` in place and return None."""
    module = trainer.lightning_module if trainer is not None else None
    for obj in implementers(trainer, hook):
        fn = getattr(obj, hook)
        out = fn(value, *args) if obj is module else fn(trainer, module, value, *args)
        if hook in _HANDS_ON:
            value = out
    return value if hook in _HANDS_ON else None
