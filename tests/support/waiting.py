"""Waiting in tests for events, never against a wall-clock budget.

No test may pass or fail by the machine's speed: a compile, a server start-up or a training step can
take many times longer on a loaded machine. So a test waits until the thing it waits for has happened,
and fails early only when that can no longer happen (the process or thread that would make it happen
is gone). A real hang is caught by pytest-timeout's per-test limit (pyproject.toml, `timeout`), which
is far above any run's time.
"""

from __future__ import annotations

import subprocess
import threading
import time
from typing import Callable


def wait_until(condition: Callable[[], bool], alive: Callable[[], bool] = lambda: True, what: str = "",
               poll_s: float = 0.05) -> None:
    """Return once `condition()` holds; fail (naming `what`) when `alive()` turns false before it does."""
    while not condition():
        if not alive():
            if condition():
                return
            raise AssertionError(f"gave up waiting for {what or 'the condition'}: what would make it true is gone")
        time.sleep(poll_s)


def wait_event(event: threading.Event, alive: Callable[[], bool] = lambda: True, what: str = "") -> None:
    """`wait_until(event.is_set, alive, what)` without polling while the event is due."""
    while not event.wait(0.5):
        if not alive():
            if event.is_set():
                return
            raise AssertionError(f"gave up waiting for {what or 'the event'}: what would set it is gone")


def running(proc: subprocess.Popen) -> Callable[[], bool]:
    """`alive` for a child process: true while it has not exited."""
    return lambda: proc.poll() is None
