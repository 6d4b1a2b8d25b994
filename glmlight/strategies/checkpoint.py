"""Checkpoint files: which are written and kept, written atomically, checked before a resume, what an
interrupted run keeps; each rank's own RL state.

`checkpoint_callback` writes `checkpoints/epoch=0-step=N.ckpt` every `trainer.checkpoint_every_n_steps` RL
steps (N counts optimizer steps) and `checkpoints/last.ckpt` beside them (at each, and at the end of
training), keeping the newest `trainer.keep_last_k_checkpoints` periodic ones; with
`checkpoint_every_n_steps=0` nothing is written.

A checkpoint is written to a temporary file and renamed into place, so a run
killed mid-write leaves the previous checkpoint intact (a sharded FSDP2 checkpoint
is a directory, written the same way by `glmlight.strategies.fsdp.RLFSDPStrategy`). Before
resuming, the file is checked (a torch checkpoint is a zip archive: a truncated or
corrupted file fails its directory or CRC check; a sharded one needs its
torch.distributed.checkpoint `.metadata`, its shard files and a whole `meta.pt`) and
a bad one is named in a one-line error that lists the earlier checkpoints to resume
from instead.
"""

from __future__ import annotations

import glob
import logging
import os
import zipfile
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from glmlight.errors import ConfigError

log = logging.getLogger(__name__)


def checkpoint_callback(trainer_cfg: Any, optimizer_steps_per_rl_step: int) -> ModelCheckpoint | None:
    """The run's checkpoints (module docstring), or None when `checkpoint_every_n_steps` is 0. The newest k
    are told apart by Lightning's always-present `step` (the global step, larger = newer)."""
    every = trainer_cfg.checkpoint_every_n_steps
    if not every:
        return None
    keep = trainer_cfg.get("keep_last_k_checkpoints", None)
    return ModelCheckpoint(dirpath=os.path.join(trainer_cfg.default_root_dir, "checkpoints"),
                           every_n_train_steps=every * optimizer_steps_per_rl_step, save_last=True,
                           monitor="step" if keep else None, mode="max", save_top_k=keep or -1)


def checkpoint_global_step(path: str) -> int | None:
    """The global (optimizer) step a checkpoint was written at, read without loading its tensors (memory-
    mapped); None when it cannot be read."""
    import torch

    target = os.path.join(path, "meta.pt") if os.path.isdir(path) else path
    try:
        state = torch.load(target, map_location="cpu", mmap=True, weights_only=True)
        return int(state["global_step"])
    except Exception:  # noqa: BLE001 - any unreadable checkpoint: the step is just not known
        return None


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        path = str(path)
        tmp = f"{path}.tmp-{os.getpid()}"
        super().save_checkpoint(checkpoint, tmp, storage_options)
        os.replace(tmp, path)


def checkpoint_problem(path: str) -> str | None:
    """Why `path` cannot be resumed from, or None if it looks whole."""
    if os.path.isdir(path):
        return _sharded_checkpoint_problem(path)
    if not os.path.isfile(path):
        return "file does not exist"
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        return f"not a complete checkpoint ({e})"
    return f"corrupted member {bad}" if bad else None


def _sharded_checkpoint_problem(path: str) -> str | None:
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):  # DeepSpeed's layout: latest names the tag directory of model/optimizer states
        with open(latest) as f:
            tag = os.path.join(path, f.read().strip())
        return None if glob.glob(os.path.join(tag, "*model_states.pt")) else f"DeepSpeed checkpoint without {tag}"
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return "sharded checkpoint without its .metadata (incomplete)"
    if not glob.glob(os.path.join(path, "*.distcp")):
        return "sharded checkpoint without shard files"
    meta = checkpoint_problem(os.path.join(path, "meta.pt"))
    return f"meta.pt: {meta}" if meta else None


def other_checkpoints(path: str) -> list[str]:
    folder = os.path.dirname(os.path.abspath(path))
    found = [p for p in glob.glob(os.path.join(folder, "*.ckpt")) if os.path.abspath(p) != os.path.abspath(path)]
    return sorted(found, key=os.path.getmtime, reverse=True)


def verified_resume_path(path: str) -> str:
    problem = checkpoint_problem(path)
    if problem is None:
        return path
    good = [p for p in other_checkpoints(path) if checkpoint_problem(p) is None]
    hint = f"resume from the previous good one with trainer.resume='{good[0]}'" if good else "no earlier good checkpoint"
    raise ConfigError(f"checkpoint {path} cannot be resumed from: {problem}; {hint}")


# ---------------------------------------------------------------------------- per-rank RL state
# Lightning writes one copy of the non-tensor state (rank 0's). Under data parallelism every rank has
# its own prompt-stream shard, queued async groups, engine seed stream, RNG and callback counters, so
# the checkpoint keeps all of them and each rank resumes its own.
RANKS_KEY = "ranks"


def save_rank_state(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """Gather every rank's RNG, data-module and callback state into checkpoint["glmlight"]["ranks"]
    (a collective: every rank calls it while the checkpoint is assembled)."""
    if trainer is None or trainer.world_size == 1:
        return
    import torch.distributed as dist

    dm = trainer.datamodule
    mine = {"rng": checkpoint["glmlight"]["rng"], "callbacks": checkpoint.get("callbacks"),
            "datamodule": checkpoint.get(type(dm).__qualname__) if dm is not None else None}
    everyone: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(everyone, mine)
    checkpoint["glmlight"][RANKS_KEY] = everyone


def restore_rank_state(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """Put this rank's own saved state where Lightning and RLModule restore it from (before they do)."""
    ranks = checkpoint.get("glmlight", {}).get(RANKS_KEY)
    if not ranks or trainer is None:
        return
    if len(ranks) != trainer.world_size:
        log.warning("checkpoint was written by %d ranks, this run has %d: every rank resumes rank 0's prompt "
                    "stream, RNG and callback state", len(ranks), trainer.world_size)
        return
    mine = ranks[trainer.global_rank]
    checkpoint["glmlight"]["rng"] = mine["rng"]
    if mine["callbacks"] is not None:
        checkpoint["callbacks"] = mine["callbacks"]
    dm = trainer.datamodule
    if dm is not None and mine["datamodule"] is not None:
        checkpoint[type(dm).__qualname__] = mine["datamodule"]
