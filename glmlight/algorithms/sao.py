"""SAO: single-rollout asynchronous actor-critic (Hou et al. 2026; GLM-5 agentic RL).

One rollout per prompt, no group baseline: a critic supplies the baseline.
  - policy loss: DIS (GLM-5 Eq. 3–5), a double-sided token mask on r = π_θ / π_rollout;
  - advantages: skip-observation GAE over action tokens, λ_policy = 1 − 1/(α·l) per sequence;
  - critic: the policy backbone with a scalar head (or a separate checkpoint), its own optimizer,
    K updates per policy update, λ_critic = 1, optional frozen attention, warm-up steps,
    optional value normalisation and value clipping.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from glmlight.algorithms.base import RLModule
from glmlight.config.schema import AlgoConfig
from glmlight.strategies.distributed import global_moments
from glmlight.models.lora import frozen_backbone, is_lora
from glmlight.ops.gae import adaptive_lambda, explained_variance, masked_scale, masked_whiten, skip_observation_gae
from glmlight.ops.reduce import masked_mean
from glmlight.ops.value import merge_moments, segment_terminals, terminal_rewards, turn_rewards, value_loss
from glmlight.config.ranges import ranges
from glmlight.config.registry import register_algorithm
from glmlight.sample import Experience


@dataclass
class SAOConfig(AlgoConfig):
    name: str = "sao"
    policy_loss: str = "dis"
    dis_eps_low: float = 0.3  # math; 0.8 / 3.0 for code (SAO)
    dis_eps_high: float = 5.0
    critic_lr: float = 1e-3
    critic_updates: int = 2  # K critic steps per policy step
    critic_warmup_steps: int = 0  # RL steps in which only the critic trains
    critic_freeze_attention: bool = True  # train only MLP/MoE layers, norms and the value head
    critic_path: Optional[str] = None  # a separate critic backbone checkpoint; None = copy of the policy
    value_normalization: bool = False  # running mean/std of returns
    value_clip: Optional[float] = None
    gamma: float = 1.0
    lambda_alpha: float = 1.5  # λ_policy = 1 − 1/(α·l): SAO's α (VAPO's is 0.05; see ops.gae.adaptive_lambda)
    lambda_critic: float = 1.0
    whiten_advantages: bool = True
    # Where the environment's rewards go on the tokens: "terminal" = the episode's reward on its last action
    # token; "turns" = each turn's reward (multi-turn environments that pay per turn) on that turn's last
    # token and the rest at the end (ops.value.turn_rewards): credit where it was earned.
    reward_placement: str = field(default="terminal", metadata={"choices": ("terminal", "turns")})


ranges(SAOConfig, critic_lr=">= 0", critic_updates=">= 1", critic_warmup_steps=">= 0", value_clip="> 0",
       gamma="[0, 1]", lambda_alpha="> 0", lambda_critic="[0, 1]")


class ValueModel(nn.Module):
    """A transformer backbone with a scalar head: V(s_t) for every position."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_policy(cls, policy: nn.Module) -> "ValueModel":
        if is_lora(policy):  # the value head on the policy's frozen base (no copy): only the head trains
            return cls(frozen_backbone(policy), policy.config.hidden_size)
        return cls(copy.deepcopy(policy.base_model), policy.config.hidden_size)

    @classmethod
    def from_checkpoint(cls, path: str) -> "ValueModel":
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(path, local_files_only=True, use_safetensors=True)
        return cls(backbone, backbone.config.hidden_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state
        # a fresh tensor, not a view (FSDP2 hooks the output of a sharded module for its backward)
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float().clone()

    def freeze_attention(self) -> int:
        """Freeze every attention parameter (MLA projections and the DSA indexer); returns how many."""
        n = 0
        for name, p in self.backbone.named_parameters():
            if ".self_attn." in name:
                p.requires_grad_(False)
                n += p.numel()
        return n


class RunningMeanStd(nn.Module):
    """Running mean / variance of returns (Welford over batches); saved with the module. Under data
    parallelism a batch is the union of every rank's (`glmlight.strategies.distributed.global_moments`), so all
    ranks keep the same statistics."""

    def __init__(self, eps: float = 1e-4):
        super().__init__()
        self.register_buffer("mean", torch.zeros((), dtype=torch.float64))
        self.register_buffer("var", torch.ones((), dtype=torch.float64))
        self.register_buffer("count", torch.tensor(eps, dtype=torch.float64))

    def update(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Add the values of `x` (where `mask` is 1) of every rank's batch."""
        mean, var, count = global_moments(x, torch.ones_like(x) if mask is None else mask)
        if count:
            self.mean, self.var, self.count = merge_moments(self.mean, self.var, self.count, mean.to(self.mean),
                                                            var.to(self.var), count)

    @property
    def std(self) -> torch.Tensor:
        return self.var.sqrt().clamp(min=1e-6)


@register_algorithm("sao", SAOConfig)
class SAO(RLModule):
    cfg: SAOConfig

    def __init__(self, cfg: SAOConfig, policy: nn.Module, **kw: Any):
        super().__init__(cfg, policy, **kw)
        self.critic = ValueModel.from_checkpoint(cfg.critic_path) if cfg.critic_path else ValueModel.from_policy(policy)
        self.critic.train()
        self.frozen_critic_params = self.critic.freeze_attention() if cfg.critic_freeze_attention else 0
        self.value_norm = RunningMeanStd() if cfg.value_normalization else None

    @property
    def optimizer_steps_per_rl_step(self) -> int:
        return (1 + self.cfg.critic_updates) * self.cfg.ppo_epochs * self.cfg.num_minibatches

    def sharded_modules(self) -> list[nn.Module]:
        return [*super().sharded_modules(), self.critic]

    def normalisers(self, mb: Experience) -> dict[str, float]:
        """The policy loss's denominators and the critic's token count (action tokens)."""
        return {**super().normalisers(mb), "critic_tokens": float(mb.action_mask.sum())}

    def configure_optimizers(self) -> Any:
        return [self.make_optimizer(self.policy, self.cfg.lr),
                self.make_optimizer(self.critic, self.cfg.critic_lr, steps_per_update=self.cfg.critic_updates)]

    # ----------------------------------------------------------------- values
    def critic_values(self, exp: Experience) -> torch.Tensor:
        """V(s_t) for each response token t (the state before t is produced): [B, T]."""
        v = self.critic(exp.input_ids, exp.attention_mask, exp.position_ids)
        return v[:, exp.prompt_length - 1 : -1]

    def _denormalize(self, v: torch.Tensor) -> torch.Tensor:
        return v if self.value_norm is None else v * self.value_norm.std.float() + self.value_norm.mean.float()

    def prepare_experience(self, batch: Experience) -> None:
        super().prepare_experience(batch)
        with torch.no_grad():
            self.critic.eval()
            batch.values = self.parallel.per_row(batch, self.critic_values)
            self.critic.train()

    def token_rewards(self, batch: Experience, mask: torch.Tensor) -> torch.Tensor:
        """r_t [B, T] as `reward_placement` says. With "turns", each segment of a trajectory (the samples of
        one rollout_id) gets its turns' rewards where they were paid and, at its last action token, the
        rest of the trajectory's reward (`segment_terminals`): later segments' turns and what no turn was
        paid. Samples without turn rewards (single-turn tasks) get their reward at the end, as "terminal"."""
        if self.cfg.reward_placement == "terminal":
            return terminal_rewards(batch.rewards, mask)
        placed = [s.metadata.get("turn_rewards", ()) for s in batch.samples]
        rows: dict[tuple[int, int], dict[int, list[int]]] = {}  # trajectory -> segment -> rows (padding repeats rows)
        for i, s in enumerate(batch.samples):
            rows.setdefault((s.group_id, s.rollout_id), {}).setdefault(s.segment, []).append(i)
        ends = [0.0] * len(batch.samples)
        for segments in rows.values():
            order = sorted(segments)
            total = float(batch.rewards[segments[order[0]][0]])
            own = [sum(r for _, r in placed[segments[k][0]]) for k in order]
            for k, end in zip(order, segment_terminals(total, own)):
                for i in segments[k]:
                    ends[i] = end
        return turn_rewards(mask, placed, ends)

    def compute_advantages(self, batch: Experience) -> None:
        cfg, mask = self.cfg, batch.action_mask
        rewards = self.token_rewards(batch, mask)
        values = self._denormalize(batch.values) * mask
        lengths = mask.sum(-1).clamp(min=1)
        lam = adaptive_lambda(lengths, cfg.lambda_alpha)
        adv, _ = skip_observation_gae(rewards, values, mask, cfg.gamma, lam)
        _, returns = skip_observation_gae(rewards, values, mask, cfg.gamma, cfg.lambda_critic)
        self.set_targets(batch, adv, returns, values, mask)
        batch.stats["train/lambda_policy_mean"] = float(lam.mean())

    def set_targets(self, batch: Experience, adv: torch.Tensor, returns: torch.Tensor, values: torch.Tensor,
                    mask: torch.Tensor, center: bool = True) -> None:
        """Critic targets (normalised when value normalisation is on), advantages, and their statistics.
        With whiten_advantages the advantages are whitened over the batch's action tokens; `center=False`
        only divides by their std (signs and ratios kept)."""
        if self.value_norm is not None:
            self.value_norm.update(returns, mask)
            batch.returns = (returns - self.value_norm.mean.float()) / self.value_norm.std.float()
        else:
            batch.returns = returns
        if self.cfg.whiten_advantages:  # by the moments of every rank's advantages
            mean, var, _ = global_moments(adv, mask)
            adv_out = masked_whiten(adv, mask, mean=mean, var=var) if center else masked_scale(adv, mask, var=var)
        else:
            adv_out = adv
        batch.advantages = adv_out * mask
        adv_mean = masked_mean(adv, mask)
        batch.stats.update({
            "critic/explained_variance": float(explained_variance(values, returns, mask)),
            "critic/value_mean": float(masked_mean(values, mask)),
            "critic/return_mean": float(masked_mean(returns, mask)),
            "train/advantage_mean": float(adv_mean),
            "train/advantage_std": float(masked_mean((adv - adv_mean) ** 2, mask).sqrt()),
        })

    # ----------------------------------------------------------------- updates
    def critic_loss(self, mb: Experience, scale: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        values = self.critic_values(mb)
        mask = mb.action_mask
        # A token mean over the whole minibatch: the micro-batches' losses add up to it.
        vl = value_loss(values, mb.values, mb.returns, mask, self.cfg.value_clip, total_tokens=scale["critic_tokens"])
        return vl, {"critic/value_loss": vl.detach() * scale["critic_tokens"] / mask.sum().clamp(min=1.0)}

    def minibatch_update(self, batch: Experience, rows: torch.Tensor) -> dict[str, float]:
        warming_up = self.rl_step < self.cfg.critic_warmup_steps
        stats = self.optimizer_step(self._optimizer(0), self._scheduler(0), self.policy,
                                    lambda mb, scale: self.micro_batch_loss(mb, scale), batch, rows, skip=warming_up)
        for _ in range(self.cfg.critic_updates):  # the critic's token mean: over `normalisers`' critic_tokens
            for k, v in self.optimizer_step(self._optimizer(1), self._scheduler(1), self.critic, self.critic_loss,
                                            batch, rows).items():
                stats[k] = v
        stats["train/policy_warmup"] = float(warming_up)
        return stats
