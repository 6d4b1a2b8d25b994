"""RLModule: the LightningModule every algorithm builds on.

One training step = one rollout batch, read top to bottom in glmlight/algorithms/step.py:

    Experience ─► train-side old log-probs (θ_old, no grad; or from the update's forward) [+ reference]
               ─► on_experience hooks (corrections, monitors), in callback order
               ─► advantages (the algorithm's own)
               ─► ppo_epochs × num_minibatches optimizer steps (micro-batched)

It holds two parts it builds with explicit arguments: `scoring` (log-probs, entropy, the reference:
glmlight/algorithms/scoring.py) and `parallel` (micro-batches, and what the trainer's strategy asks of the
passes: glmlight/algorithms/parallel.py).

Subclasses implement `compute_advantages` and may add loss terms through
`extra_loss`. A policy with MTP layers (model.mtp) also trains them with `mtp_loss`, whose gradient reaches
only them (docs/models.md). `trainer.max_steps` in the config counts RL steps; Lightning's
global_step counts optimizer steps (`optimizer_steps_per_rl_step` per RL step).
"""

from __future__ import annotations

import copy
import logging
import math
import random
from collections import Counter
from typing import Any, Callable, Iterator

import lightning.pytorch as pl
import torch

from glmlight.algorithms import replay as replay_
from glmlight.algorithms.parallel import ParallelSteps
from glmlight.algorithms.scoring import LOGPROB_FLOOR, PolicyScoring
from glmlight.algorithms.step import rl_step
from glmlight.strategies.checkpoint import restore_rank_state, save_rank_state
from glmlight.config.schema import AlgoConfig
from glmlight.strategies.base import rl_strategy
from glmlight.strategies.distributed import all_reduce_gradients, clip_grad_norm, global_sums, grad_scale, grads_finite
from glmlight.hooks import EvalTarget, call_rl_hooks, with_hook
from glmlight.models.lora import check_trainable_state, is_lora, keep_trainable_state
from glmlight.models.mtp import mtp_of, num_mtp_layers
from glmlight.ops.dis import dis_loss_per_token
from glmlight.ops.kl import kl_penalty
from glmlight.ops.mtp import mtp_loss_terms, mtp_mask
from glmlight.ops.policy_loss import ppo_clip_loss
from glmlight.ops.reduce import aggregate_loss, loss_normalisers, masked_mean
from glmlight.ops.schedule import lr_lambda
from glmlight.sample import Experience, Sample

log = logging.getLogger(__name__)
# Statistics of a micro-batch that are its share of the minibatch's loss (divided by the whole minibatch's
# normaliser): summed over micro-batches and ranks, as the loss is, where the others are means over rows.
LOSS_SHARES = ("train/pg_loss",)


class NonFiniteLossError(RuntimeError):
    pass


class RLModule(pl.LightningModule):
    # Whether compute_advantages reads batch.old_logprobs (then they are computed before the update).
    advantages_read_old_logprobs = False
    # Whether the advantages' baseline is the group's own rewards, so a group whose rewards are all equal
    # carries no learning signal (callbacks.RunHealth says so when that is most groups).
    group_baseline = False

    def __init__(self, cfg: AlgoConfig, policy: torch.nn.Module, *, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, max_new_tokens: int = 64, pad_token_id: int = 0, use_glm_forward: bool = False,
                 filter_order: str = "sequential"):
        super().__init__()
        self.cfg = cfg
        self.policy = policy.train()
        self.max_new_tokens = max_new_tokens
        self.pad_token_id = pad_token_id
        self.automatic_optimization = False
        self.policy_version = 0
        self._nonfinite_streak = 0
        replay_mode = getattr(cfg, "replay", "none")  # algo.replay (glmlight/algorithms/replay.py)
        replay_.check_model(policy, replay_mode)
        self.records_filter: replay_.RecordsFilter | None = None  # set at fit start when replay is on
        # The frozen reference lives outside the module's parameters (in `scoring`): never trained, never
        # checkpointed. A LoRA policy's reference is its own frozen base (adapters disabled): no copy.
        self.lora = is_lora(policy)
        if self.lora:
            self.strict_loading = False  # checkpoints hold the adapters, not the frozen base
        # The MTP layers (`glmlight.models.mtp`): trained with algo.mtp_loss_coef beside the policy loss, on a
        # gradient path of their own (glmlight/models/glm5/forward.py, `forward_logits_mtp`)
        self.mtp_coef = float(getattr(cfg, "mtp_loss_coef", 0.0)) if num_mtp_layers(policy) else 0.0
        reference = []
        if cfg.kl_coef > 0 and not self.lora:
            ref = copy.deepcopy(policy).eval()
            ref.requires_grad_(False)
            reference.append(ref)
        # The passes over micro-batches and ranks (glmlight/algorithms/parallel.py)
        self.parallel = ParallelSteps(cfg.micro_batch_size, getattr(cfg, "micro_batch_tokens", None),
                                      self.attached_trainer)
        # Log-probs, entropy and the reference's log-probs (glmlight/algorithms/scoring.py), under the
        # sampling distribution (glmlight.ops.logprobs): the trainer's log-probs are taken under the same
        # temperature / top-k / top-p processing as the engine's, so both are the same quantity.
        self.scoring = PolicyScoring(
            self.policy, self.parallel, temperature=temperature if temperature > 0 else 1.0, top_k=top_k,
            top_p=top_p, filter_order=filter_order, replay_mode=replay_mode, use_glm_forward=use_glm_forward,
            share_prompt_forward=bool(getattr(cfg, "share_prompt_forward", False)), reference=reference,
            reference_is_base=cfg.kl_coef > 0 and self.lora)

    def attached_trainer(self) -> pl.Trainer | None:
        """The Lightning trainer this module is attached to (None before `fit` attaches it)."""
        return self._trainer

    # ----------------------------------------------------------------- steps
    @property
    def optimizer_steps_per_rl_step(self) -> int:
        return self.cfg.ppo_epochs * self.cfg.num_minibatches

    @property
    def rl_step(self) -> int:
        return self.global_step // self.optimizer_steps_per_rl_step

    def training_step(self, dataloader_iter: Iterator[Experience]) -> None:
        """One RL step: rollout, scoring, corrections, advantages, update (glmlight/algorithms/step.py)."""
        rl_step(self, dataloader_iter)

    def compute_advantages(self, batch: Experience) -> None:
        raise NotImplementedError

    def extra_loss(self, mb: Experience, logits: torch.Tensor, logprobs: torch.Tensor,
                   mask: torch.Tensor, scale: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Additional loss terms of a subclass (already aggregated); default none."""
        return logprobs.new_zeros(()), {}

    def on_fit_start(self) -> None:
        replay_.start(self, self.scoring.replay_mode)  # the engine records what is replayed

    def evaluation_targets(self) -> list[EvalTarget]:
        """Other models to evaluate beside the policy at the start of training (glmlight.hooks); none."""
        return []

    @property
    def filters_rollout_samples(self) -> bool:
        """Whether `on_rollout_samples` has anything to do in this run (glmlight.hooks)."""
        return self.records_filter is not None

    def on_rollout_samples(self, samples: list[Sample], counts: Counter, policy_version: int) -> list[Sample]:
        """The module's own check of a rollout round (glmlight.hooks): with `algo.replay`, samples without
        the records replay needs are dropped and counted."""
        return samples if self.records_filter is None else self.records_filter(samples, counts, policy_version)

    def old_logprob_readers(self) -> list[str]:
        """What reads batch.old_logprobs before the update: the algorithm's advantages, and every
        callback with an `on_experience` hook unless it declares `reads_old_logprobs = False`."""
        readers = [type(self).__name__] if self.advantages_read_old_logprobs else []
        callbacks = self.trainer.callbacks if self._trainer is not None else []
        return readers + [type(cb).__name__ for cb in with_hook(callbacks, "on_experience")
                          if getattr(cb, "reads_old_logprobs", True)]

    def old_logprobs_from_update(self) -> bool:
        """Whether θ_old's log-probs are the update's own forward, detached, instead of a separate
        no-grad forward. Exact when every token is trained once, at θ_old (ppo_epochs =
        num_minibatches = 1): the first forward of the update runs at θ_old. TRL does the same with
        num_iterations=1. `algo.old_logprobs` = forward | update | auto (update when exact and
        nothing reads them before the update)."""
        cfg = self.cfg
        if cfg.old_logprobs == "forward":
            return False
        exact = cfg.ppo_epochs == 1 and cfg.num_minibatches == 1
        readers = self.old_logprob_readers()
        if cfg.old_logprobs == "update":
            if readers:
                raise ValueError(f"algo.old_logprobs=update, but {', '.join(readers)} read the old log-probs "
                                 "before the update; use algo.old_logprobs=forward (or auto)")
        return exact and not readers

    def prepare_experience(self, batch: Experience) -> None:
        was_training = self.policy.training
        self.policy.eval()
        from_update = self.old_logprobs_from_update()
        scoring = self.scoring
        batch.old_logprobs = None if from_update else scoring.compute_logprobs(self.policy, batch)
        if batch.old_logprobs is not None and scoring.filters(batch):
            outside = (batch.old_logprobs <= LOGPROB_FLOOR).float()
            batch.stats["train/outside_kept_set_frac"] = float(masked_mean(outside, batch.loss_mask))
        batch.stats["train/old_logprobs_from_update"] = float(from_update)
        ref = scoring.reference_logprobs(batch)
        if ref is not None:
            batch.ref_logprobs = ref
        self.policy.train(was_training)
        batch.token_weights = torch.ones_like(batch.loss_mask)

    def run_experience_hooks(self, batch: Experience) -> None:
        """`on_experience(trainer, module, batch)` of every callback that implements it, in order (glmlight.hooks)."""
        call_rl_hooks(self._trainer, "on_experience", batch)

    def _minibatches(self, n: int) -> list[torch.Tensor]:
        """Exactly num_minibatches row sets (some empty when the batch is smaller), shuffled per step."""
        k = self.cfg.num_minibatches
        g = torch.Generator().manual_seed(self.global_step)
        perm = torch.randperm(n, generator=g) if k > 1 else torch.arange(n)
        chunks = list(perm.chunk(k))
        return chunks + [perm[:0]] * (k - len(chunks))

    def _optimizer(self, index: int = 0) -> Any:
        opts = self.optimizers()
        return opts[index] if isinstance(opts, (list, tuple)) else opts

    def _scheduler(self, index: int = 0) -> Any:
        scheds = self.lr_schedulers()
        return scheds[index] if isinstance(scheds, (list, tuple)) else scheds

    def update(self, batch: Experience) -> dict[str, float]:
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for _ in range(self.cfg.ppo_epochs):
            for rows in self._minibatches(batch.batch_size):
                for k, v in self.minibatch_update(batch, rows).items():
                    sums[k] = sums.get(k, 0.0) + v
                    counts[k] = counts.get(k, 0) + 1
        metrics = {k: v / counts[k] for k, v in sums.items()}
        metrics["train/lr"] = self._optimizer().param_groups[0]["lr"]
        return metrics

    def minibatch_update(self, batch: Experience, rows: torch.Tensor) -> dict[str, float]:
        """The optimizer steps of one minibatch (subclasses add critic steps)."""
        return self.optimizer_step(self._optimizer(), self._scheduler(), self.policy,
                                   lambda mb, scale: self.micro_batch_loss(mb, scale), batch, rows,
                                   idle_rows=self.rows_without_gradient)

    def rows_without_gradient(self, mb: Experience) -> torch.Tensor | None:
        """Boolean [B]: rows of `mb` whose policy loss is identically zero, so the update skips their
        forward and backward (their gradient is exactly zero). None (the default): every row trains."""
        return None

    @staticmethod
    def _step_without_update(opt: Any, sched: Any) -> dict[str, float]:
        """Count the optimizer step without changing parameters (no gradients), keeping the step budget."""
        opt.zero_grad(set_to_none=True)
        opt.step()
        if sched is not None:
            sched.step()
        return {}

    def optimizer_step(self, opt: Any, sched: Any, model: torch.nn.Module, loss_fn: Any, batch: Experience,
                       rows: torch.Tensor, skip: bool = False,
                       idle_rows: Callable[[Experience], torch.Tensor | None] | None = None) -> dict[str, float]:
        """One optimizer step over `rows` of `batch`, micro-batched. With no rows (or skip) the step
        still counts (no gradients: parameters stay), so every RL step has the same number of steps.
        `idle_rows(minibatch)` marks rows whose loss is identically zero: they count in the loss's
        normalisers but run no forward; statistics are means over the rows that ran."""
        opt.zero_grad(set_to_none=True)
        params = [p for p in model.parameters() if p.requires_grad]
        mtp_params = self.mtp_parameters() if model is self.policy else []
        if skip:
            return self._step_without_update(opt, sched)
        totals: dict[str, float] = {}
        loss_value = 0.0
        model.train()
        mb_all = batch.select(rows)
        # The global minibatch's denominators (summed over ranks, even by a rank with no rows) and the
        # factor that makes the ranks' averaged gradients the global loss's (glmlight.strategies.distributed).
        scale = {**global_sums(self.normalisers(mb_all)), "grad_scale": grad_scale()}
        parallel = self.parallel
        idle = idle_rows(mb_all) if idle_rows is not None and len(rows) and parallel.ranks_may_skip_rows() else None
        active = torch.arange(len(rows)) if idle is None else (~idle.cpu()).nonzero().squeeze(1)
        micros = parallel.collective(parallel.micro_batches(active, mb_all))
        for i, micro in enumerate(micros):
            loss, stats = loss_fn(parallel.select(mb_all if micro is not None else batch, micro), scale)
            parallel.mark_boundary(i == len(micros) - 1)
            self.manual_backward(loss * (scale["grad_scale"] if micro is not None else 0.0))
            if micro is None:
                continue
            loss_value += loss.item()
            for k, v in stats.items():  # means over the rows that ran, but a share of the loss adds up
                totals[k] = totals.get(k, 0.0) + v.item() * (1.0 if k in LOSS_SHARES else len(micro) / len(active))
        if idle is not None:
            totals["train/rows_without_gradient_frac"] = 1.0 - len(active) / len(rows)
            if not len(active):  # what backward of the all-zero loss would leave: zero gradients
                for p in params:
                    p.grad = torch.zeros_like(p)
        if not parallel.sharded:
            all_reduce_gradients(params)  # data parallel: every rank joins, even with no rows (FSDP reduces its own)
        loss_value = global_sums({"loss": loss_value})["loss"]  # the global minibatch's loss
        if model is self.policy:  # and its policy-loss part, summed over ranks as the loss is
            totals.update(global_sums({k: totals.get(k, 0.0) for k in LOSS_SHARES}))
        if parallel.engine_steps and micros:
            prefix = "train" if model is self.policy else "critic"
            return {**totals, **parallel.engine_step(opt, sched, prefix, loss_value)}
        if all(p.grad is None for p in params):
            return self._step_without_update(opt, sched)
        if not grads_finite(params) or not math.isfinite(loss_value):
            self._nonfinite_streak += 1
            log.warning("non-finite loss at step %d (%d in a row): update skipped", self.global_step,
                        self._nonfinite_streak)
            if self._nonfinite_streak >= self.cfg.max_nonfinite_steps:
                raise NonFiniteLossError(f"loss was not finite in {self._nonfinite_streak} consecutive updates; "
                                         "stopping (lower the learning rate or check rewards and data)")
            return {**self._step_without_update(opt, sched), "train/skipped_nonfinite": 1.0}
        self._nonfinite_streak = 0
        clip = self.cfg.grad_clip or float("inf")
        if mtp_params:  # each clipped by its own norm: the MTP loss leaves the policy's update as it is
            mtp_ids = {id(p) for p in mtp_params}
            grad_norm = clip_grad_norm([p for p in params if id(p) not in mtp_ids], clip)
            totals["train/mtp_grad_norm"] = float(clip_grad_norm(mtp_params, clip))
        else:
            grad_norm = clip_grad_norm(params, clip)
        opt.step()
        if sched is not None:
            sched.step()
        prefix = "train" if model is self.policy else "critic"
        totals.update({f"{prefix}/loss": loss_value, f"{prefix}/grad_norm": float(grad_norm),
                       "train/skipped_nonfinite": 0.0})
        return totals

    def mtp_parameters(self) -> list[torch.nn.Parameter]:
        """The policy's trainable MTP parameters (none without MTP layers)."""
        mtp = mtp_of(self.policy)
        return [p for p in mtp.parameters() if p.requires_grad] if mtp is not None else []

    def mtp_loss(self, mb: Experience, mtp_logits: list[torch.Tensor],
                 scale: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The MTP loss of a micro-batch: depth d's cross-entropy summed over the response tokens it predicts
        (`glmlight.ops.mtp.mtp_mask`: those the policy's loss counts), over the minibatch's trained tokens,
        averaged over depths (so the micro-batches add up to a token mean). Statistics: the micro-batch's
        token-mean cross-entropy (`train/mtp_loss`) and argmax accuracy per depth (`train/mtp_accuracy@d`)."""
        total = mb.loss_mask.new_zeros((), dtype=torch.float32)
        stats: dict[str, torch.Tensor] = {}
        ce_means = []
        for d, logits in enumerate(mtp_logits, start=1):
            mask = mtp_mask(mb.loss_mask, mb.attention_mask, mb.prompt_length, d)
            ce, correct, n = mtp_loss_terms(logits, mb.response_ids, mask)
            total = total + ce / max(scale["total_tokens"], 1.0)
            ce_means.append(ce.detach() / n.clamp(min=1))
            stats[f"train/mtp_accuracy@{d}"] = correct / n.clamp(min=1)
        stats["train/mtp_loss"] = torch.stack(ce_means).mean()
        return total / len(mtp_logits), stats

    def micro_batch_loss(self, mb: Experience, scale: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.cfg
        mtp_logits = None
        scoring = self.scoring
        if self.mtp_coef:
            logits, mtp_logits = scoring.forward_logits_mtp(self.policy, mb)
        else:
            logits = scoring.forward_logits(self.policy, mb)
        logprobs = scoring.logprobs(logits, mb.response_ids, mb)
        mask = mb.loss_mask
        pg, stats = self.policy_loss(mb, logprobs)
        if mb.token_weights is not None:
            pg = pg * mb.token_weights
        per_token = pg
        if mb.ref_logprobs is not None:
            kl = kl_penalty(logprobs, mb.ref_logprobs, cfg.kl_estimator)
            per_token = per_token + cfg.kl_coef * kl
            stats["train/kl"] = masked_mean(kl.detach(), mask)
        if cfg.entropy_coef or cfg.log_entropy:
            entropy = scoring.entropy(logits, mask, with_grad=bool(cfg.entropy_coef), exp=mb)
            if cfg.entropy_coef:
                per_token = per_token - cfg.entropy_coef * entropy
            stats["train/entropy"] = masked_mean(entropy.detach(), mask)
        loss = aggregate_loss(per_token, mask, cfg.loss_agg, constant=cfg.loss_agg_constant or self.max_new_tokens,
                              num_sequences=scale["num_sequences"], total_tokens=scale["total_tokens"],
                              num_rows=scale.get("num_rows"))
        extra, extra_stats = self.extra_loss(mb, logits, logprobs, mask, scale)
        stats.update(extra_stats)
        stats["train/pg_loss"] = loss.detach()
        if mtp_logits is not None:
            mtp, mtp_stats = self.mtp_loss(mb, mtp_logits, scale)
            stats.update(mtp_stats)
            extra = extra + self.mtp_coef * mtp
        return loss + extra, {k: torch.as_tensor(v).detach().float() for k, v in stats.items()}

    def policy_loss(self, mb: Experience, logprobs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token policy-gradient loss [B, T] (before token weights and aggregation) and its
        statistics: `ppo_loss` or `dis_loss` by `algo.policy_loss`. Override to use another loss."""
        return getattr(self, f"{self.cfg.policy_loss}_loss")(mb, logprobs)

    def ppo_loss(self, mb: Experience, logprobs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """PPO clip with clip-higher and optional dual clip, against θ_old (`glmlight.ops.policy_loss`)."""
        cfg, mask = self.cfg, mb.loss_mask
        old = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach()  # θ_old = θ (see above)
        out = ppo_clip_loss(logprobs, old, mb.advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip_c)
        return out.loss, {"train/clip_frac": masked_mean(out.clipped, mask),
                          "train/dual_clip_frac": masked_mean(out.dual_clipped, mask),
                          "train/ratio_mean": masked_mean(out.ratio, mask)}

    def dis_loss(self, mb: Experience, logprobs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """GLM-5's DIS: a double-sided trust window on π_θ / π_rollout (`glmlight.ops.dis`)."""
        cfg = self.cfg
        pg, kept = dis_loss_per_token(logprobs, mb.rollout_logprobs, mb.advantages, cfg.dis_eps_low, cfg.dis_eps_high)
        return pg, {"train/dis_masked_frac": 1.0 - masked_mean(kept.float(), mb.loss_mask)}

    def normalisers(self, mb: Experience) -> dict[str, float]:
        """This rank's share of the loss denominators of minibatch `mb` (summed over ranks before use:
        glmlight.strategies.distributed)."""
        return loss_normalisers(mb.loss_mask)

    def sharded_modules(self) -> list[torch.nn.Module]:
        """What trainer.strategy=fsdp shards: the policy and the frozen reference (subclasses add theirs)."""
        return [self.policy, *self.scoring.reference]

    def configure_model(self) -> None:
        """Under an `RLStrategy` (glmlight/strategies/base.py) hand the strategy the module
        (`configure_for`: DeepSpeed takes its gradient clipping), then, under a sharded one, each model of
        `sharded_modules` (`shard`: FSDP2 shards each decoder layer, then the root); nothing otherwise."""
        strategy = rl_strategy(self._trainer)
        if strategy is None:
            return
        strategy.configure_for(self)
        if strategy.rl_sharded:
            for model in self.sharded_modules():
                strategy.shard(model)

    # ----------------------------------------------------------------- optim
    def configure_optimizers(self) -> Any:
        return self.make_optimizer(self.policy, self.cfg.lr)

    def make_optimizer(self, model: torch.nn.Module, lr: float, steps_per_update: int = 1) -> dict[str, Any]:
        """AdamW over the trainable parameters with warm-up and the configured schedule; the schedule
        counts this optimizer's steps (`steps_per_update` of them per policy update)."""
        cfg = self.cfg
        params = [p for p in model.parameters() if p.requires_grad]
        # the fused kernel (one pass per tensor) where torch has one: on CPU it steps 4x faster than
        # the default per-tensor loop; sharded (DTensor) and other devices' parameters keep the default
        fused = bool(params) and all(type(p) is torch.nn.Parameter and p.device.type in ("cpu", "cuda") for p in params)
        opt = torch.optim.AdamW(params, lr=lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                                fused=fused or None)
        rl_steps = max(int(self.trainer.max_steps) // self.optimizer_steps_per_rl_step, 1) if self._trainer else 1
        per_rl = self.cfg.ppo_epochs * self.cfg.num_minibatches * steps_per_update
        warmup, total = cfg.warmup_steps * per_rl, rl_steps * per_rl
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.lr_schedule, warmup, total, cfg.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def reset_optimizer_state(self) -> None:
        """Forget Adam moments (GLM-5 agentic RL resets the optimizer after a weight push)."""
        for opt in self.trainer.optimizers:
            opt.state.clear()

    # ----------------------------------------------------------------- checkpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.lora:  # the adapters (and a value head), not the frozen base
            keep_trainable_state(self, checkpoint)
        checkpoint["glmlight"] = {"policy_version": self.policy_version, "nonfinite_streak": self._nonfinite_streak,
                                  "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
        save_rank_state(self.trainer, checkpoint)  # each data-parallel rank's own stream, RNG and callbacks

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        restore_rank_state(self.trainer, checkpoint)
        if self.lora:
            check_trainable_state(self, checkpoint)
        state = checkpoint.get("glmlight", {})
        self.policy_version = state.get("policy_version", 0)
        self._nonfinite_streak = state.get("nonfinite_streak", 0)
        if "rng" in state:
            torch.set_rng_state(state["rng"]["torch"])
            random.setstate(_as_tuple(state["rng"]["python"]))


def _as_tuple(x: Any) -> Any:
    """random.setstate needs the nested tuples back (a checkpoint may hold lists)."""
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x

