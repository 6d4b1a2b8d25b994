"""What the data-parallel equivalence tests share: fixed or recorded batches fed to the real
Trainer, and a recorder of gradients and gathered parameters.

`ReplayData` is the real `RolloutDataModule` (engine, prompt stream, weight sync target) except that
each step's samples come from a list given to it instead of from the engine: rank r trains on
`batches[r][step]`. That is how N ranks and one process are made to train on exactly the same
global batch (one process on the union of the ranks' samples).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import lightning.pytorch as pl
import torch

from glmlight.data.rollout import RolloutDataModule
from glmlight.sample import Experience, Sample
from glmlight.strategies.fsdp import full_weights


def full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor from a possibly sharded one (a collective for DTensors: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().double().cpu().clone()


class ReplayData(RolloutDataModule):
    """A RolloutDataModule whose step k yields `batches[rank][k]` (a list of Samples)."""

    def __init__(self, real: RolloutDataModule, batches: list[list[list[Sample]]]):
        self.__dict__.update(real.__dict__)  # the real module's engine, tokenizer, stream, filters
        self.replay, self._k = batches, 0

    def next_experience(self) -> Experience:
        rank = self.trainer.global_rank if self.trainer is not None else 0
        samples = [Sample.from_dict(s.to_dict()) for s in self.replay[rank][self._k]]
        self._k += 1
        exp = Experience.collate(samples, pad_token_id=self.tokenizer.pad_token_id)
        exp.stats["rollout/reward_mean"] = float(exp.rewards.mean())
        return exp


class Recorder(pl.Callback):
    """Every optimizer step's (whole) gradients and every RL step's (whole) parameters, kept on
    rank 0 and saved to `path` at the end of fit; also each rank's engine weights after each step."""

    def __init__(self, path: str):
        self.path = path
        self.grads: list[dict[str, torch.Tensor]] = []
        self.params: list[dict[str, torch.Tensor]] = []
        self.engine: list[float] = []
        self.sharded = False

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: Any, optimizer: Any) -> None:
        named = {n: p for n, p in module.named_parameters() if p.requires_grad}
        # a missing gradient is a zero one (data parallelism fills them in so that every rank joins)
        self.grads.append({n: full(p.grad) if p.grad is not None else torch.zeros(p.shape, dtype=torch.float64)
                           for n, p in named.items()})

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
        from torch.distributed.tensor import DTensor

        self.sharded = all(isinstance(p, DTensor) for p in module.policy.parameters())
        names = {n for n, _ in module.named_parameters()}
        self.params.append({n: full(t) for n, t in full_weights(module) if n in names})
        engine = trainer.datamodule.engine.model
        policy = {n: full(t) for n, t in full_weights(module.policy)}
        # the engine's weights equal the trainer's (each rank checks its own engine)
        self.engine.append(max(float((v.double() - policy[n]).abs().max())
                               for n, v in engine.state_dict().items()))

    def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
        engines = [None] * trainer.world_size
        if trainer.world_size > 1:
            torch.distributed.all_gather_object(engines, self.engine)
        else:
            engines = [self.engine]
        if trainer.global_rank == 0:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            torch.save({"grads": self.grads, "params": self.params, "engine_gap": engines, "sharded": self.sharded},
                       self.path)


def max_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


RANK_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT")


def launch(module: str, *args: str, cwd: str) -> subprocess.CompletedProcess:
    """`python -m module args` (Lightning starts the second rank itself); once more if the rendezvous
    port Lightning picked was taken in the meantime (other jobs on a shared machine)."""
    # a rank's environment from an earlier in-process run would make Lightning skip launching rank 1
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    for attempt in range(2):
        proc = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                              check=False, env=env)
        if "EADDRINUSE" not in proc.stderr or attempt:
            return proc
    return proc
