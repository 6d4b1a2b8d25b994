"""Checkpoint files: written atomically, checked before a resume.

A checkpoint is written to a temporary file and renamed into place, so a run
killed mid-write leaves the previous checkpoint intact. Before resuming, the file
is checked (a torch checkpoint is a zip archive: a truncated or corrupted file
fails its directory or CRC check) and a bad one is named in a one-line error that
lists the earlier checkpoints to resume from instead.
"""

from __future__ import annotations

import glob
import os
import zipfile
from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO

from glmlight.errors import ConfigError


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        path = str(path)
        tmp = f"{path}.tmp-{os.getpid()}"
        super().save_checkpoint(checkpoint, tmp, storage_options)
        os.replace(tmp, path)


def checkpoint_problem(path: str) -> str | None:
    """Why `path` cannot be resumed from, or None if it looks whole."""
    if not os.path.isfile(path):
        return "file does not exist"
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        return f"not a complete checkpoint ({e})"
    return f"corrupted member {bad}" if bad else None


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
