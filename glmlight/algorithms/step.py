"""One RL step, top to bottom: what `RLModule.training_step` runs, stage by stage, and the hooks
(`glmlight.hooks`) where they fire. Each stage is a method of the module, so an algorithm overrides a
stage, never the order.

    1. rollout      next(dataloader_iter) -> RolloutDataModule.next_experience: the engine generates
                    (token ids and log-probs), the reward scores, every round's samples pass through
                    the `on_rollout_samples` hooks (module, then callbacks), groups are padded or
                    dropped and counted, the survivors collated into one `Experience`
    2. scoring      module.prepare_experience: θ_old's log-probs from the policy (replaying the engine's
                    recorded experts / DSA keys with algo.replay), or from the update's own forward;
                    the reference's log-probs (kl_coef > 0; its own routing)
    3. corrections  module.run_experience_hooks: `on_experience` of every callback, in order (IcePop,
                    TIS, MIS, rejection sampling, the mismatch and agreement monitors)
    4. advantages   module.compute_advantages: the algorithm's own (group, teacher, GAE)
    5. update       module.update: ppo_epochs x num_minibatches optimizer steps, micro-batched
    6. metrics      logged once per RL step, with the step's time split
    7. sync         after this function returns, Lightning's `on_train_batch_end`: WeightSync pushes
                    the weights and advances `module.policy_version` once the engine acknowledges
"""

from __future__ import annotations

import time
from typing import Any, Iterator

from glmlight.metrics import log_metrics
from glmlight.sample import Experience


def rl_step(module: Any, dataloader_iter: Iterator[Any]) -> dict[str, float]:
    """One RL step of `module` (an RLModule); returns the logged metrics."""
    # 1. rollout (in async mode the batch was generated while the previous step trained)
    t_wait = time.perf_counter()
    item = next(dataloader_iter)  # Lightning yields (batch, batch_idx, dataloader_idx)
    t_batch = time.perf_counter()
    batch: Experience = (item[0] if isinstance(item, tuple) else item).to(module.device)

    # 2. scoring: old and reference log-probs
    module.prepare_experience(batch)

    # 3. corrections and monitors: on_experience hooks
    module.run_experience_hooks(batch)

    # 4. advantages
    module.compute_advantages(batch)

    # 5. update
    t0 = time.perf_counter()
    metrics = module.update(batch)
    trained_tokens = float(batch.loss_mask.sum()) * module.cfg.ppo_epochs
    metrics["train/tokens_per_s"] = trained_tokens / max(time.perf_counter() - t0, 1e-9)

    # 6. metrics
    metrics.update(batch.stats)
    metrics["rollout/wait_seconds"] = t_batch - t_wait  # the trainer waiting for this batch
    metrics["train/seconds"] = time.perf_counter() - t_batch  # old log-probs, hooks, advantages, update
    metrics["policy_version"] = float(module.policy_version)
    staleness = [module.policy_version - s.first_version for s in batch.samples if s.first_version >= 0]
    if staleness:
        metrics["rollout/staleness_max"] = float(max(staleness))
        metrics["rollout/staleness_mean"] = sum(staleness) / len(staleness)
    metrics["rl_step"] = float(module.rl_step)
    if module._trainer is not None:
        log_metrics(module.trainer, metrics)
    return metrics
    # 7. sync: Lightning's on_train_batch_end (WeightSync), after training_step returns
