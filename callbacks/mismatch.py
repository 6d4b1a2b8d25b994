"""MismatchMonitor: how far the engine's probabilities are from the trainer's (validation contract).

Per step it logs, over action tokens: mismatch KL E[log π_rollout − log π_train],
k3 KL, training and rollout log-perplexity and their difference, χ² at token and
sequence level and the trusted-token ratio (k inside [low, high]). Sums are kept
in a torchmetrics Metric, so the values are correct across ranks. Every
`probe_every_n_steps` it also runs a greedy probe: the engine answers a few
prompts greedily and the trainer's argmax over the same tokens is compared.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torchmetrics

from glmlight.hooks import RLCallback
from glmlight.ops.mismatch import mismatch_sums, reduce_mismatch_sums, token_agreement
from glmlight.engines.base import SamplingParams
from glmlight.sample import Experience

_KEYS = ("token_count", "seq_count", "kl_sum", "k3_kl_sum", "chi2_token_sum", "train_log_ppl_sum",
         "rollout_log_ppl_sum", "chi2_seq_sum", "trusted_token_sum")


class MismatchMetric(torchmetrics.Metric):
    """Sums of mismatch_sums, reduced by summation across processes."""

    full_state_update = False

    def __init__(self, low: float, high: float):
        super().__init__()
        self.low, self.high = low, high
        for k in _KEYS:
            self.add_state(k, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> None:
        sums = mismatch_sums(train_logprobs, rollout_logprobs, mask, self.low, self.high)
        for k in _KEYS:
            if k in sums:
                setattr(self, k, getattr(self, k) + sums[k].double())

    def compute(self) -> dict[str, torch.Tensor]:
        return reduce_mismatch_sums({k: getattr(self, k).float() for k in _KEYS})


class MismatchMonitor(RLCallback):
    """Logs the train/inference mismatch of every step (`mismatch/*`) and, every
    `probe_every_n_steps`, the greedy token agreement between engine and trainer.

    Args:
        low, high: the band of the trusted-token ratio (k inside [low, high]).
        max_mismatch_kl: stop the run when |mismatch KL| exceeds it (None: never).
        probe_every_n_steps: the greedy probe's period in RL steps (0: off).
        probe_prompts, probe_tokens: the probe's size.

    Raises:
        RuntimeError: during training, when the mismatch KL passes `max_mismatch_kl`.
    """

    def __init__(self, low: float = 0.5, high: float = 2.0, max_mismatch_kl: float | None = None,
                 probe_every_n_steps: int = 10, probe_prompts: int = 4, probe_tokens: int = 16):
        self.low, self.high = low, high
        self.max_mismatch_kl = max_mismatch_kl
        self.probe_every_n_steps, self.probe_prompts, self.probe_tokens = probe_every_n_steps, probe_prompts, probe_tokens
        self.metric = MismatchMetric(low, high)

    def on_experience(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Experience) -> None:
        self.metric.to(batch.old_logprobs.device)
        # Measured on the original action tokens, before corrections change the mask.
        self.metric.update(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask)
        values = {f"mismatch/{k}": float(v) for k, v in self.metric.compute().items()}
        self.metric.reset()
        batch.stats.update(values)
        if self.probe_every_n_steps > 0 and module.rl_step % self.probe_every_n_steps == 0:
            batch.stats["mismatch/token_agreement"] = self.greedy_probe(trainer, module, batch)
        kl = values.get("mismatch/mismatch_kl")
        if self.max_mismatch_kl is not None and kl is not None and abs(kl) > self.max_mismatch_kl:
            raise RuntimeError(f"mismatch KL {kl:.4g} exceeds max_mismatch_kl={self.max_mismatch_kl}: the engine and "
                               "the trainer disagree (check rollout.dtype, weight sync and the model's kernels)")

    @torch.no_grad()
    def greedy_probe(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Experience) -> float:
        """Fraction of positions where the trainer's argmax equals the engine's greedy token."""
        prompts = [s.prompt_ids for s in batch.samples[: self.probe_prompts]]
        # Under the generation lock (never beside an async rollout's generation), with a seed of its own:
        # the probe must not draw from the engine's seed stream (training's).
        with trainer.datamodule.engine_aside() as engine:
            gens = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=self.probe_tokens, seed=0))
        matches, total = 0.0, 0.0
        was_training = module.policy.training
        module.policy.eval()
        for p, g in zip(prompts, gens):
            if not g.token_ids:
                continue
            ids = torch.tensor([p + g.token_ids], device=module.device)
            logits = module.policy(input_ids=ids).logits[:, len(p) - 1 : -1]
            tokens = torch.tensor([g.token_ids], device=module.device)
            n = len(g.token_ids)
            matches += float(token_agreement(logits.argmax(-1), tokens, torch.ones_like(tokens))) * n
            total += n
        module.policy.train(was_training)
        return matches / max(total, 1.0)
