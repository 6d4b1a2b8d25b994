"""RunHealth: says once, while the run goes on, when a step's samples show that the run cannot learn as
configured: most answers cut at the length limit (`rollout/truncated_frac`), or most groups without a
learning signal because every answer of the group got the same reward (`rollout/equal_reward_group_frac`,
for algorithms whose baseline is the group's mean reward: GRPO). Each warning names the setting to change.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from glmlight.data.rollout_stats import equal_reward_group_frac
from glmlight.hooks import RLCallback
from glmlight.sample import Status

log = logging.getLogger(__name__)


class RunHealth(RLCallback):
    """After every RL step, a warning (once per run and kind) when more than `truncated_frac` of the step's
    answers stopped at the length limit, or, for a group-baseline algorithm, more than
    `equal_reward_group_frac` of its groups had all rewards equal. A threshold of 1 turns that warning off.

    Args:
        truncated_frac: the share of truncated answers above which the length limit is reported.
        equal_reward_group_frac: the share of groups without signal above which they are reported.
    """

    def __init__(self, truncated_frac: float = 0.5, equal_reward_group_frac: float = 0.5):
        for name, value in (("truncated_frac", truncated_frac), ("equal_reward_group_frac", equal_reward_group_frac)):
            if not 0 <= value <= 1:
                raise ValueError(f"RunHealth {name} must be in [0, 1], got {value}")
        self.truncated_frac = truncated_frac
        self.equal_reward_group_frac = equal_reward_group_frac
        self.said: set[str] = set()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        samples = getattr(batch, "samples", None)
        if not samples or not trainer.is_global_zero:
            return
        cfg = getattr(trainer.datamodule, "cfg", None)
        step = getattr(module, "rl_step", None)
        if "truncated" not in self.said:
            cut = sum(s.status is Status.TRUNCATED for s in samples)
            if cut / len(samples) > self.truncated_frac:
                self.said.add("truncated")
                log.warning(truncation_message(step, cut, len(samples), getattr(cfg, "max_new_tokens", None),
                                               getattr(cfg, "max_context", None)))
        if "equal_rewards" not in self.said and getattr(module, "group_baseline", False):
            frac = equal_reward_group_frac(samples)
            if frac is not None and frac > self.equal_reward_group_frac:
                self.said.add("equal_rewards")
                log.warning(equal_rewards_message(step, frac, type(module).__name__,
                                                  getattr(cfg, "n_samples_per_prompt", None),
                                                  bool(getattr(cfg, "dynamic_sampling", False))))


def truncation_message(step: int | None, cut: int, total: int, max_new_tokens: int | None,
                       max_context: int | None) -> str:
    return (f"RL step {step}: {cut} of {total} answers ({cut / total:.0%}) stopped at the length limit "
            f"rollout.max_new_tokens={max_new_tokens} (or the prompt + answer budget rollout.max_context="
            f"{max_context}); a cut answer rarely earns its reward: raise rollout.max_new_tokens to fit the task's "
            f"answers. rollout/truncated_frac logs the share every step (said once)")


def equal_rewards_message(step: int | None, frac: float, algorithm: str, group_size: int | None,
                          dynamic_sampling: bool) -> str:
    drop = "" if dynamic_sampling else "; rollout.dynamic_sampling=true drops such groups and samples new ones"
    return (f"RL step {step}: in {frac:.0%} of the groups every answer got the same reward, so {algorithm} learns "
            f"nothing from them (their advantages are 0): the task is too hard or too easy for the model "
            f"(python scripts/samples.py <run dir> shows answers; change the task or the model), the reward "
            f"cannot tell the answers apart, or the groups are too small (rollout.n_samples_per_prompt="
            f"{group_size}){drop}. rollout/equal_reward_group_frac logs the share every step (said once)")
