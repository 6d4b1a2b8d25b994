"""What an RL module does differently when it trains on several ranks, and how it cuts a batch into
micro-batches; the `RLModule` base mixes it in.

- Normalisers: `normalisers` are a rank's share of a minibatch's loss denominators, summed over
  ranks before use (glmlight.strategies.distributed).
- Sharded strategies (FSDP2: glmlight.strategies.fsdp; DeepSpeed: glmlight.strategies.zero): every forward and
  backward of a sharded model is a collective, so every rank runs as many as the busiest one
  (`_collective`); `configure_model` shards the models of `sharded_modules`.
- DeepSpeed's engine reduces, clips and steps (`_engine_steps`, `_mark_boundary`, `_engine_step`).
- Micro-batches by rows or by token count (`_micro_batches`, `_select`, glmlight.algorithms.microbatch);
  `per_row` runs a per-token function over them and puts the rows back in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from glmlight.algorithms import microbatch
from glmlight.strategies.distributed import global_max
from glmlight.ops.reduce import loss_normalisers
from glmlight.sample import Experience


class ParallelSteps:
    """Mixed into `RLModule` (a LightningModule with `cfg`, `policy` and `_reference`)."""

    cfg: Any
    policy: torch.nn.Module
    _reference: list[torch.nn.Module]
    _trainer: Any  # Lightning's, set when the module is attached to a Trainer
    trainer: Any

    def per_row(self, exp: Experience, fn: Callable[[Experience], torch.Tensor]) -> torch.Tensor:
        """`fn` ([b, t] per response token) over the micro-batches of `exp`, as one [B, T] tensor."""
        parts = []
        for idx in self._collective(self._micro_batches(torch.arange(exp.batch_size), exp)):
            out = fn(self._select(exp, idx))
            if idx is not None:
                parts.append((idx, out))
        return microbatch.place_rows(parts, exp.batch_size, exp.response_length)

    def _micro_batches(self, rows: torch.Tensor, exp: Experience | None = None) -> list[torch.Tensor]:
        """`rows` (of `exp`) in micro-batches: chunks of micro_batch_size rows, or packed by token count
        with `algo.micro_batch_tokens` (`glmlight.algorithms.microbatch`); none for no rows."""
        budget = getattr(self.cfg, "micro_batch_tokens", None)
        if budget and exp is not None:
            prompts, responses = microbatch.row_lengths(exp)
            at = rows.to(prompts.device)
            return microbatch.by_tokens(rows, prompts[at], responses[at], budget)
        return microbatch.by_rows(rows, self.cfg.micro_batch_size)

    def _select(self, exp: Experience, idx: torch.Tensor | None) -> Experience:
        """Rows `idx` of `exp` (trimmed to their own columns with micro_batch_tokens); None: a pass that
        only keeps this rank in step with the others (`_collective`): one row, nothing to train on."""
        if idx is None:
            mb = exp.select([0])
            mb.loss_mask, mb.action_mask = torch.zeros_like(mb.loss_mask), torch.zeros_like(mb.action_mask)
            return mb
        mb = exp.select(idx)
        return microbatch.trim(mb) if getattr(self.cfg, "micro_batch_tokens", None) else mb

    @property
    def sharded(self) -> bool:
        """Whether the models are FSDP2-sharded (trainer.strategy=fsdp, glmlight.strategies.fsdp)."""
        return self._trainer is not None and bool(getattr(self.trainer.strategy, "rl_sharded", False))

    def _collective(self, chunks: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Under FSDP every forward of a sharded model is a collective, so every rank runs as many as the
        busiest one: `chunks` padded with None (passes whose results are dropped)."""
        if not self.sharded:
            return list(chunks)
        return list(chunks) + [None] * (global_max(len(chunks)) - len(chunks))

    @property
    def _engine_steps(self) -> bool:
        """Whether the strategy's engine reduces, clips and steps (DeepSpeed: glmlight.strategies.zero)."""
        return self._trainer is not None and bool(getattr(self.trainer.strategy, "rl_engine_steps", False))

    def _mark_boundary(self, last: bool) -> None:
        """DeepSpeed: the last backward pass of an optimizer step is its gradient-accumulation boundary."""
        if self._engine_steps:
            engine = self.trainer.model
            engine.set_gradient_accumulation_boundary(last)
            # what DeepSpeed's engine.forward does first (the module's forward is called directly): the next
            # backward accumulates onto the previous ones' gradients (ZeRO-3 would otherwise overwrite them)
            clear = getattr(engine.optimizer, "clear_backward_seen_flag", None)
            if callable(clear):
                clear()

    def _engine_step(self, opt: Any, sched: Any, model: torch.nn.Module, loss_value: float) -> dict[str, float]:
        opt.step()  # DeepSpeed's engine: reduce the last buckets, clip (trainer's grad_clip), step, zero
        if sched is not None:
            sched.step()
        prefix = "train" if model is self.policy else "critic"
        return {f"{prefix}/loss": loss_value, f"{prefix}/grad_norm": float(self.trainer.model.get_global_grad_norm() or 0.0),
                "train/skipped_nonfinite": 0.0}

    def normalisers(self, mb: Experience) -> dict[str, float]:
        """This rank's share of the loss denominators of minibatch `mb` (summed over ranks before use)."""
        return loss_normalisers(mb.loss_mask)

    def sharded_modules(self) -> list[torch.nn.Module]:
        """What trainer.strategy=fsdp shards: the policy and the frozen reference (subclasses add theirs)."""
        return [self.policy, *self._reference]

    def configure_model(self) -> None:
        """Under trainer.strategy=fsdp (`glmlight.strategies.fsdp.RLFSDPStrategy`) shard every model of
        `sharded_modules` with FSDP2 (each decoder layer, then the root); under deepspeed
        (`glmlight.strategies.zero`) hand DeepSpeed the gradient clipping; nothing otherwise."""
        strategy = self.trainer.strategy
        if callable(getattr(strategy, "configure_for", None)):
            strategy.configure_for(self)
        if self.sharded and callable(getattr(strategy, "shard", None)):
            for model in self.sharded_modules():
                strategy.shard(model)
