"""Data parallelism for RL modules: the collectives, in one place.

An RL step runs many forward/backward passes inside one `training_step` (old
log-probs, epochs × minibatches × micro-batches, critic updates), which
DistributedDataParallel's reducer does not allow. So `trainer.strategy=ddp` keeps
the module unwrapped (`RLDDPStrategy`): rank 0's parameters are broadcast once at setup, and
`RLModule` all-reduces (averages) gradients itself before every optimizer step.
Under `trainer.strategy=fsdp` (FSDP2, glmlight/strategies/fsdp.py) FSDP averages the
gradients itself. Each rank rolls out its own shard of prompts with its own engine.

Normalisers are global: a loss's denominators (tokens, sequences), advantage
whitening and the critic's running return statistics are summed over ranks
(`global_sums`, `global_moments`), so N ranks train exactly like one process on the
union of their batches. Gradients are averaged over N ranks, so each rank's loss is
scaled by `grad_scale()` = N: the average of N · (rank's share of the global loss)
is the global loss.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy


class RLDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy leaving the module unwrapped (trainer.strategy=ddp): every rank starts from
    rank 0's weights and `RLModule` averages the gradients itself (an `RLStrategy`,
    glmlight/strategies/base.py)."""

    rl_gradient_sync = True  # the module all-reduces gradients after its passes
    rl_sharded = False
    rl_engine_steps = False

    def configure_ddp(self) -> None:
        from lightning.pytorch.overrides.distributed import _sync_module_states

        _sync_module_states(self.model)  # every rank starts from rank 0's weights (no DDP wrapper)

    def configure_for(self, module: Any) -> None:
        """Nothing to take from the module."""

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # every rank holds whole models


def world_size() -> int:
    """Data-parallel ranks taking part (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def grad_scale() -> float:
    """What each rank's loss is multiplied by before backward: gradients are averaged over the ranks,
    so N · (the rank's share of the global loss) averages to the global loss's gradient."""
    return float(world_size())


def global_sums(values: dict[str, float]) -> dict[str, float]:
    """`values` summed over ranks (one all-reduce of a float64 vector; every rank must call it with
    the same keys in the same order)."""
    if world_size() == 1:
        return dict(values)
    flat = torch.tensor(list(values.values()), dtype=torch.float64)
    dist.all_reduce(flat)
    return dict(zip(values, flat.tolist()))


def global_max(n: int) -> int:
    """The largest `n` of any rank."""
    if world_size() == 1:
        return n
    t = torch.tensor([n], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def global_any(flag: bool) -> bool:
    """Whether `flag` is true on any rank."""
    return global_max(int(flag)) > 0


def global_moments(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Mean, population variance and count of `x` over the mask tokens of every rank's batch (two
    passes: the global mean first, then the squared deviations from it; float64)."""
    from glmlight.ops.gae import masked_sums

    total, count = masked_sums(x, mask)
    s = global_sums({"sum": total, "count": count})
    mean = s["sum"] / max(s["count"], 1.0)
    (sq,) = masked_sums((x.double() - mean) ** 2, mask)[:1]
    var = global_sums({"sq": sq})["sq"] / max(s["count"], 1.0)
    return torch.tensor(mean, dtype=torch.float64), torch.tensor(var, dtype=torch.float64), s["count"]


def all_reduce_gradients(params: list[torch.nn.Parameter]) -> None:
    """Average gradients across ranks (missing gradients count as zeros, so every rank joins)."""
    if world_size() < 2:
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


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def is_sharded(params: Iterable[torch.Tensor]) -> bool:
    """Whether any of `params` is a DTensor (a shard of FSDP2)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


def grads_finite(params: list[torch.nn.Parameter]) -> bool:
    """Whether every gradient is finite on every rank (sharded gradients: each rank checks its shard,
    and all ranks agree, so that all of them skip a step or none)."""
    local = all(bool(torch.isfinite(_local(p.grad)).all()) for p in params if p.grad is not None)
    return not global_any(not local) if is_sharded(params) else local


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Scale the gradients to total L2 norm <= max_norm (inf: measure only); returns the norm before.
    FSDP2 shards: the squared norms of the local shards are summed over ranks."""
    if not is_sharded(params):
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    grads = [p.grad for p in params if p.grad is not None]
    sq = sum(float(_local(g).double().square().sum()) for g in grads)
    total = math.sqrt(global_sums({"sq": sq})["sq"])
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for g in grads:
            _local(g).mul_(coef)
    return total
