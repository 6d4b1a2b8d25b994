"""weight_sync=shm: a transport's two shared-memory slots (`transport.SharedMemorySlots`), made at the first
update; each update is written into the slot the servers do not serve from, so the served one stays whole
for a rollback."""

from __future__ import annotations

import time

from glmlight.engines import transport as wt


class ShmSlots:
    """See the module docstring; `write` records its seconds in the `seconds` dict it is given."""

    def __init__(self, shm_dir: str = "/dev/shm"):
        self.shm_dir = shm_dir
        self._slots: wt.SharedMemorySlots | None = None

    def write(self, named: list, config_dir: str | None, served_path: str | None, seconds: dict[str, float]) -> str:
        """Write `named` into the slot that is not `served_path`; its directory."""
        if self._slots is None:
            self._slots = wt.SharedMemorySlots(self.shm_dir, config_dir)
        t = time.perf_counter()
        path = self._slots.write(named, served_path)
        seconds["write"] = time.perf_counter() - t
        return path

    def close(self) -> None:
        if self._slots is not None:
            self._slots.close()
