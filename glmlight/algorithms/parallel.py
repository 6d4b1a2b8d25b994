"""How an RL module lays its passes out: micro-batches, and what its trainer's strategy asks of them.
`RLModule` (glmlight/algorithms/base.py) holds one `ParallelSteps`, built with its micro-batch settings and
a way to reach its trainer.

- Micro-batches by rows or by token count (`micro_batches`, `select`, glmlight.algorithms.microbatch);
  `per_row` runs a per-token function over them and puts the rows back in order.
- Sharded strategies (FSDP2: glmlight.strategies.fsdp; DeepSpeed: glmlight.strategies.zero): every forward and
  backward of a sharded model is a collective, so every rank runs as many as the busiest one
  (`collective`). What the strategy is: its `RLStrategy` flags (glmlight/strategies/base.py).
- DeepSpeed's engine reduces, clips and steps (`engine_steps`, `mark_boundary`, `engine_step`).
- Data parallel with the module unwrapped: a rank may skip rows the others run (`ranks_may_skip_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from glmlight.algorithms import microbatch
from glmlight.sample import Experience
from glmlight.strategies.base import RLStrategy, rl_strategy
from glmlight.strategies.distributed import global_max


class ParallelSteps:
    """The passes of one RL module. `micro_batch_size` rows per micro-batch, or `micro_batch_tokens` (None:
    off) tokens per packed micro-batch; `attached_trainer()`: the Lightning trainer the module is attached to
    (None before it is)."""

    def __init__(self, micro_batch_size: int, micro_batch_tokens: int | None,
                 attached_trainer: Callable[[], Any]):
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.attached_trainer = attached_trainer

    def per_row(self, exp: Experience, fn: Callable[[Experience], torch.Tensor]) -> torch.Tensor:
        """`fn` ([b, t] per response token) over the micro-batches of `exp`, as one [B, T] tensor."""
        parts = []
        for idx in self.collective(self.micro_batches(torch.arange(exp.batch_size), exp)):
            out = fn(self.select(exp, idx))
            if idx is not None:
                parts.append((idx, out))
        return microbatch.place_rows(parts, exp.batch_size, exp.response_length)

    def micro_batches(self, rows: torch.Tensor, exp: Experience | None = None) -> list[torch.Tensor]:
        """`rows` (of `exp`) in micro-batches: chunks of micro_batch_size rows, or packed by token count
        with `algo.micro_batch_tokens` (`glmlight.algorithms.microbatch`); none for no rows."""
        budget = self.micro_batch_tokens
        if budget and exp is not None:
            prompts, responses = microbatch.row_lengths(exp)
            at = rows.to(prompts.device)
            return microbatch.by_tokens(rows, prompts[at], responses[at], budget)
        return microbatch.by_rows(rows, self.micro_batch_size)

    def select(self, exp: Experience, idx: torch.Tensor | None) -> Experience:
        """Rows `idx` of `exp` (trimmed to their own columns with micro_batch_tokens); None: a pass that
        only keeps this rank in step with the others (`collective`): one row, nothing to train on."""
        if idx is None:
            mb = exp.select([0])
            mb.loss_mask, mb.action_mask = torch.zeros_like(mb.loss_mask), torch.zeros_like(mb.action_mask)
            return mb
        mb = exp.select(idx)
        return microbatch.trim(mb) if self.micro_batch_tokens else mb

    @property
    def strategy(self) -> RLStrategy | None:
        """The trainer's strategy when it is an `RLStrategy` (glmlight/strategies/base.py)."""
        return rl_strategy(self.attached_trainer())

    @property
    def sharded(self) -> bool:
        """Whether every forward and backward is a collective (FSDP2: glmlight.strategies.fsdp; ZeRO)."""
        strategy = self.strategy
        return strategy is not None and bool(strategy.rl_sharded)

    def ranks_may_skip_rows(self) -> bool:
        """Whether a rank may run fewer forward/backward passes than the others: yes on one process and
        under glmlight's data parallelism (gradients all-reduced once, after the passes); no under
        FSDP / DeepSpeed, whose passes gather parameters and reduce gradients collectively."""
        trainer = self.attached_trainer()
        if trainer is None or trainer.world_size == 1:
            return True
        strategy = self.strategy
        return strategy is not None and bool(strategy.rl_gradient_sync)

    def collective(self, chunks: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Under FSDP every forward of a sharded model is a collective, so every rank runs as many as the
        busiest one: `chunks` padded with None (passes whose results are dropped)."""
        if not self.sharded:
            return list(chunks)
        return list(chunks) + [None] * (global_max(len(chunks)) - len(chunks))

    @property
    def engine_steps(self) -> bool:
        """Whether the strategy's engine reduces, clips and steps (DeepSpeed: glmlight.strategies.zero)."""
        strategy = self.strategy
        return strategy is not None and bool(strategy.rl_engine_steps)

    def mark_boundary(self, last: bool) -> None:
        """DeepSpeed: the last backward pass of an optimizer step is its gradient-accumulation boundary."""
        if self.engine_steps:
            engine = self.attached_trainer().model
            engine.set_gradient_accumulation_boundary(last)
            # what DeepSpeed's engine.forward does first (the module's forward is called directly): the next
            # backward accumulates onto the previous ones' gradients (ZeRO-3 would otherwise overwrite them)
            clear = getattr(engine.optimizer, "clear_backward_seen_flag", None)
            if callable(clear):
                clear()

    def engine_step(self, opt: Any, sched: Any, prefix: str, loss_value: float) -> dict[str, float]:
        """DeepSpeed's engine: reduce the last buckets, clip (the module's grad_clip), step, zero; the
        statistics of the step under `prefix` ("train": the policy's, "critic")."""
        opt.step()
        if sched is not None:
            sched.step()
        grad_norm = float(self.attached_trainer().model.get_global_grad_norm() or 0.0)
        return {f"{prefix}/loss": loss_value, f"{prefix}/grad_norm": grad_norm, "train/skipped_nonfinite": 0.0}
