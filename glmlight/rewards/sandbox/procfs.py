"""/proc helpers: the processes and threads of a uid, and killing all of them (also used by tests)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator


def _proc_status(pid: str) -> dict[str, str]:
    with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
        return dict(line.split(":", 1) for line in f if ":" in line)


def _live_tasks() -> Iterator[tuple[int, dict[str, str]]]:
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            st = _proc_status(entry.name)
        except OSError:
            continue
        if st.get("State", "").strip()[:1] not in ("Z", "X"):
            yield int(entry.name), st


def processes_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real or effective uid is `uid`."""
    return [pid for pid, st in _live_tasks() if str(uid) in st.get("Uid", "").split()[:2]]


def tasks_of_uid(uid: int) -> int:
    """Threads owned by real uid `uid` (what RLIMIT_NPROC counts)."""
    return sum(int(st.get("Threads", "1")) for _, st in _live_tasks() if st.get("Uid", "").split()[:1] == [str(uid)])


def kill_uid(uid: int, rounds: int = 100) -> bool:
    """SIGKILL every process of `uid` until none is left; False if some survive."""
    for _ in range(rounds):
        pids = processes_of_uid(uid)
        if not pids:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.005)
    return not processes_of_uid(uid)
