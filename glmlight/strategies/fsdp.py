"""FSDP2 for RL modules: `trainer.strategy=fsdp`.

`RLFSDPStrategy` is Lightning's `ModelParallelStrategy` (FSDP2 over a device mesh) set up for
data-parallel sharding: every rank is in the ``data_parallel`` mesh dimension (the
``tensor_parallel`` one has size 1). `RLModule.configure_model` hands each model to `shard`, which
applies `torch.distributed.fsdp.fully_shard` to every decoder layer and then to the model's root,
so parameters, gradients and optimizer state are DTensors holding 1/N of each tensor. The same
configuration runs over gloo on CPUs, nccl on GPUs and hccl on Ascend NPUs.

- Mixed precision is FSDP2's `MixedPrecisionPolicy` (`trainer.fsdp.param_dtype`,
  `trainer.fsdp.reduce_dtype`; ``trainer.precision=bf16-mixed`` means bf16 parameters in compute,
  fp32 gradient reduction), not autocast.
- Every forward of a sharded model is a collective (each layer all-gathers its parameters), so
  `RLModule` runs the same number of forward / backward passes on every rank (`collective`).
- Weight sync gathers whole tensors bucket by bucket (`full_weights`); checkpoints are sharded
  (torch.distributed.checkpoint), written to a temporary directory and renamed into place.
- Tensor parallelism: the mesh's ``tensor_parallel`` dimension is where it would go
  (`torch.distributed.tensor.parallel.parallelize_module` in an overridden
  `RLModule.configure_model`, before `shard`); glmlight does not ship a plan for it.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from glmlight.dtypes import resolve_dtype

BUCKET_BYTES = 256 * 2**20  # weight sync: whole tensors gathered per bucket


class RLFSDPStrategy(ModelParallelStrategy):
    """FSDP2 data-parallel sharding for RL modules (see the module docstring).

    Args:
        param_dtype: the dtype parameters are all-gathered and computed in (None: as stored).
        reduce_dtype: the dtype gradients are reduce-scattered in (None: param_dtype).
        reshard_after_forward: free the gathered parameters after each layer's forward (ZeRO-3-like);
            False keeps them until backward (ZeRO-2-like: more memory, fewer all-gathers).
        process_group_backend: gloo / nccl / hccl (None: the device's default).
    """

    strategy_name = "rl_fsdp2"
    # an `RLStrategy` (glmlight/strategies/base.py)
    rl_sharded = True  # RLModule: collective forwards, gradients reduced by FSDP
    rl_gradient_sync = False
    rl_engine_steps = False

    def __init__(self, *, param_dtype: str | None = None, reduce_dtype: str | None = None,
                 reshard_after_forward: bool = True, process_group_backend: str | None = None, **kwargs: Any):
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=True, process_group_backend=process_group_backend, **kwargs)
        self.param_dtype = resolve_dtype(param_dtype) if param_dtype else None
        self.reduce_dtype = resolve_dtype(reduce_dtype) if reduce_dtype else None
        self.reshard_after_forward = reshard_after_forward

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every rank shards (dp = world)
        super().setup_environment()

    @property
    def shard_mesh(self) -> Any:
        return self.device_mesh["data_parallel"]

    def mp_policy(self) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)

    def configure_for(self, module: Any) -> None:
        """Nothing to take from the module (its models come to `shard`)."""

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """fully_shard every decoder layer of `model`, then its root (in place; idempotent)."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(model, FSDPModule):
            return model
        model.to(self.root_device)
        kw = {"mesh": self.shard_mesh, "mp_policy": self.mp_policy(), "reshard_after_forward": self.reshard_after_forward}
        for layer in decoder_layers(model):
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        return model

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """A sharded checkpoint directory, written next to its place and renamed into it, so a run
        killed while saving keeps the previous checkpoint."""
        path = Path(self.broadcast(str(filepath)))
        tmp = path.with_name(path.name + ".tmp")
        if self.is_global_zero:
            shutil.rmtree(tmp, ignore_errors=True)
        self.barrier()
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier()
        if self.is_global_zero:
            old = path.with_name(path.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            if path.exists():
                path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's sharded load, except that optimizer state may be missing for parameters that never
        had a gradient (Adam keeps none for them, e.g. the DSA indexer, which trains without
        gradients): those keep the empty state torch gives a fresh optimizer."""
        from torch.distributed.checkpoint import DefaultLoadPlanner
        from torch.distributed.checkpoint import load as dcp_load
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(str(checkpoint_path)))
        if not (path / ".metadata").is_file():  # a whole-model checkpoint file
            return super().load_checkpoint(checkpoint_path, weights_only)
        model = self.model
        state = {"state_dict": get_model_state_dict(model)}
        dcp_load(state, checkpoint_id=path)
        model.load_state_dict(state["state_dict"], strict=self.lightning_module.strict_loading)
        for i, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{i}"
            optim_state = {key: get_optimizer_state_dict(model, optimizer)}
            dcp_load(optim_state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
            set_optimizer_state_dict(model, optimizer, optim_state_dict=optim_state[key],
                                     options=StateDictOptions(cpu_offload=True))
        return torch.load(path / "meta.pt", weights_only=weights_only)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The units FSDP shards one by one: modules of the classes a Hugging Face model lists in
    `_no_split_modules` (its decoder layers), else the entries of every ModuleList named `layers`."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if found:
        return found
    return [layer for name, m in model.named_modules() if name.endswith("layers")
            and isinstance(m, torch.nn.ModuleList) for layer in m]


def is_fsdp(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether whole weights need a gather first: FSDP2 (DTensor) or DeepSpeed ZeRO-3 parameters."""
    return is_fsdp(model) or any(hasattr(p, "ds_id") for p in model.parameters())


class full_weights:
    """`model.state_dict()` as (name, whole tensor) pairs, for a weight sync. Sharded (DTensor)
    entries are gathered bucket by bucket (`bucket_bytes` of whole tensors at a time) as the
    iteration reaches them (DeepSpeed ZeRO-3 parameters likewise), so one rank never holds more than
    one bucket of gathered weights on top of its shards. A collective then: every rank iterates it
    once, to the end. `nbytes` and
    `gather_seconds` count what was yielded and the time spent gathering."""

    def __init__(self, model: torch.nn.Module, bucket_bytes: int = BUCKET_BYTES):
        self.model, self.bucket_bytes = model, bucket_bytes
        self.nbytes, self.gather_seconds = 0, 0.0

    def manifest(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, whole shape, dtype) of every tensor the iteration yields, in order, gathering nothing (a
        DTensor's shape is the whole tensor's, a ZeRO-3 parameter's is its `ds_shape`): a receiver checks
        the update against it before the first bucket is gathered (`LocalEngine.update_weights`)."""
        return [(n, tuple(getattr(t, "ds_shape", t.shape)), t.dtype)
                for n, t in self.model.state_dict(keep_vars=True).items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, t in self.model.state_dict(keep_vars=True).items():
            bucket.append((name, t))
            size += getattr(t, "ds_numel", t.numel()) * t.element_size()
            if size >= self.bucket_bytes:
                yield from self._gathered(bucket)
                bucket, size = [], 0
        yield from self._gathered(bucket)

    def _gathered(self, bucket: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """FSDP2 DTensors: full_tensor(); DeepSpeed ZeRO-3 parameters: GatheredParameters (copied out)."""
        from contextlib import nullcontext

        from torch.distributed.tensor import DTensor

        t0 = time.perf_counter()
        zero3 = [t for _, t in bucket if hasattr(t, "ds_id")]
        if zero3:
            import deepspeed

            gather = deepspeed.zero.GatheredParameters(zero3)
        else:
            gather = nullcontext()
        with gather:
            whole = [(n, (t.full_tensor() if isinstance(t, DTensor) else t).detach()) for n, t in bucket]
            if zero3:
                whole = [(n, t.clone()) for n, t in whole]
        self.gather_seconds += time.perf_counter() - t0
        bucket.clear()
        for n, t in whole:
            self.nbytes += t.numel() * t.element_size()
            yield n, t
