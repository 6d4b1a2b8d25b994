"""Data parallelism for RL modules.

An RL step runs many forward/backward passes inside one `training_step` (old
log-probs, epochs × minibatches × micro-batches, critic updates), which
DistributedDataParallel's reducer does not allow. So data-parallel strategies
keep the module unwrapped: rank 0's parameters are broadcast once at setup, and
`RLModule` all-reduces (averages) gradients itself before every optimizer step.
Each rank rolls out its own shard of prompts with its own engine.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy


def _configure_without_wrapper(self: DDPStrategy) -> None:
    from lightning.pytorch.overrides.distributed import _sync_module_states

    _sync_module_states(self.model)  # every rank starts from rank 0's weights


def without_ddp_wrapper(strategy: DDPStrategy) -> DDPStrategy:
    """The same strategy object, configured to leave the module unwrapped (gradients synced by RLModule)."""
    strategy.configure_ddp = types.MethodType(_configure_without_wrapper, strategy)
    strategy.rl_gradient_sync = True
    return strategy


def all_reduce_gradients(params: list[torch.nn.Parameter]) -> None:
    """Average gradients across ranks (missing gradients count as zeros, so every rank joins)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for p, g in zip(params, torch._utils._unflatten_dense_tensors(flat, grads)):
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
