"""The stand-in's call log: every torch.npu function appends ``(name, *args)`` to `calls`."""

from __future__ import annotations

from typing import Any

calls: list[tuple[Any, ...]] = []


def record(name: str, *args: Any) -> None:
    """Append one call to the log."""
    calls.append((name, *args))


def names() -> list[str]:
    """The names of the recorded calls, in order."""
    return [entry[0] for entry in calls]
