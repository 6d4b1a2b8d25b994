"""CompactionRL (Li et al. 2026): long-horizon agents trained across their own summaries.

A trajectory is several segments (Samples sharing a rollout_id and the terminal
reward). The loss is a token mean over every trainable token of every segment in
the batch (loss_agg=token_mean: Σ m·ℓ / Σ m), not a mean per segment. Advantages
use cross-trajectory GAE: local GAE inside each segment with λ_s = 1 − 1/(1.5·L_s),
scaled by (γ·λ_s)^N_after(s), N_after(s) = trainable tokens in later segments.
The critic is SAO's. `train/summary_advantage_success` (and `_other`) is the mean advantage of the
summary tokens of successful (and other) trajectories. With whiten_advantages, the advantages are
divided by their std over the batch but not centred, so the discount between segments and every
advantage's sign survive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmlight.algorithms.sao import SAO, SAOConfig
from glmlight.groups import trajectories
from glmlight.ops.gae import cross_trajectory_gae, segment_lambda, skip_observation_gae
from glmlight.config.ranges import ranges
from glmlight.config.registry import register_algorithm
from glmlight.sample import Experience


@dataclass
class CompactionConfig(SAOConfig):
    name: str = "compaction"
    policy_loss: str = "ppo"
    loss_agg: str = "token_mean"
    segment_alpha: float = 1.5  # λ_s = 1 − 1/(α·L_s)


ranges(CompactionConfig, segment_alpha="> 0")


@register_algorithm("compaction", CompactionConfig)
class CompactionRL(SAO):
    cfg: CompactionConfig

    def compute_advantages(self, batch: Experience) -> None:
        cfg, mask = self.cfg, batch.action_mask
        values = self._denormalize(batch.values) * mask
        rewards = self.token_rewards(batch, mask)
        lengths = mask.sum(-1)
        lam = torch.tensor([segment_lambda(max(float(n), 1.0), cfg.segment_alpha) for n in lengths.tolist()])
        local, _ = skip_observation_gae(rewards, values, mask, cfg.gamma, lam.to(mask.device))
        _, returns = skip_observation_gae(rewards, values, mask, cfg.gamma, cfg.lambda_critic)
        adv = torch.zeros_like(local)
        first_row: dict[int, int] = {}  # padded groups repeat sample objects: scale each once
        for i, s in enumerate(batch.samples):
            first_row.setdefault(id(s), i)
        unique = [batch.samples[i] for i in sorted(first_row.values())]
        for traj in trajectories(unique):
            rows = [first_row[id(s)] for s in traj]
            scaled = cross_trajectory_gae([local[r] for r in rows], [mask[r] for r in rows], cfg.gamma,
                                          [float(lam[r]) for r in rows])
            for r, a in zip(rows, scaled):
                adv[r] = a
        for i, s in enumerate(batch.samples):
            adv[i] = adv[first_row[id(s)]]
        # Normalised by the std only: centring would undo the cross-trajectory discount (an early segment
        # of a successful trajectory, discounted by (γλ_s)^N_after, falls below the batch mean).
        self.set_targets(batch, adv, returns, values, mask, center=False)
        batch.stats["train/segments"] = float(len(batch.samples))
        batch.stats.update(summary_advantages(batch, mask))


def summary_mask(batch: Experience, mask: torch.Tensor) -> torch.Tensor:
    """1 on the summary tokens: the last `summary_lengths[segment]` action tokens of every segment that
    a summary closed (all but an episode's last)."""
    out = torch.zeros_like(mask)
    for i, s in enumerate(batch.samples):
        lengths = s.metadata.get("summary_lengths", ())
        if s.segment < len(lengths) and lengths[s.segment] > 0:
            pos = mask[i].nonzero().flatten()[-lengths[s.segment]:]
            out[i, pos] = 1
    return out


def summary_advantages(batch: Experience, mask: torch.Tensor) -> dict[str, float]:
    """The mean advantage of summary tokens in successful (outcome reward >= 1) and other trajectories:
    a summary that carried what the rest needed has a positive advantage when the trajectory succeeds."""
    summ = summary_mask(batch, mask).float()
    if not summ.any():
        return {}
    ok = torch.tensor([float(s.reward is not None and s.reward >= 1.0) for s in batch.samples],
                      device=summ.device).unsqueeze(-1)
    out = {"train/summary_tokens": float(summ.sum())}
    for name, rows in (("success", ok), ("other", 1.0 - ok)):
        m = summ * rows
        if m.any():
            out[f"train/summary_advantage_{name}"] = float((batch.advantages * m).sum() / m.sum())
    return out
