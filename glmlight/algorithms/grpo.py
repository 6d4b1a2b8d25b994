"""GRPO (Shao et al. 2024) with the DAPO / Dr.GRPO options: group-normalised
outcome advantages broadcast to every action token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmlight.algorithms.base import RLModule
from glmlight.config.schema import AlgoConfig
from glmlight.ops.advantages import group_advantages
from glmlight.config.registry import register_algorithm
from glmlight.sample import Experience


@dataclass
class GRPOConfig(AlgoConfig):
    name: str = "grpo"
    normalize_std: bool = True  # False = Dr.GRPO
    # Rows whose advantages are all 0 (groups with equal rewards) have exactly zero loss and gradient
    # when no KL or entropy term is on: skip their forward and backward (same update, less compute).
    skip_zero_advantage_rows: bool = True


@register_algorithm("grpo", GRPOConfig)
class GRPO(RLModule):
    cfg: GRPOConfig
    group_baseline = True

    def compute_advantages(self, batch: Experience) -> None:
        group_ids = torch.tensor([s.group_id for s in batch.samples], device=batch.rewards.device)
        adv = group_advantages(batch.rewards.cpu(), group_ids.cpu(), normalize_std=self.cfg.normalize_std)
        batch.advantages = adv.to(batch.rewards.device).unsqueeze(-1) * batch.loss_mask
        batch.stats["train/advantage_abs_mean"] = adv.abs().mean().item()

    def rows_without_gradient(self, mb: Experience) -> torch.Tensor | None:
        """Rows whose advantages are all 0 (a group whose rewards are all equal): the PPO / DIS per-token
        loss is the advantage times a finite factor, so with no KL, entropy or extra term such a row's
        loss and gradient are exactly zero (Shao et al. 2024, eq. 3 with Â = 0). With an MTP loss every row
        runs (the MTP layers learn from every rollout token; the policy's gradient is the same)."""
        cfg = self.cfg
        if (not cfg.skip_zero_advantage_rows or mb.advantages is None or mb.ref_logprobs is not None
                or cfg.entropy_coef or type(self).extra_loss is not RLModule.extra_loss or self.mtp_coef):
            return None
        return (mb.advantages == 0).all(-1)
