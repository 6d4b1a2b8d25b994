"""Run untrusted Python code in a subprocess under OS-level limits.

`run_sandboxed(code, stdin)` writes `code` to a fresh temporary directory and
runs it with the current interpreter in isolated mode (`-I -S`), feeding
`stdin` and capturing a bounded amount of stdout/stderr. The layers, each used
when the machine allows it (docs/code_reward.md says what that buys and what it
does not):

- resource limits (CPU time, address space, file size, processes, open files,
  no core dumps), a wall-clock timeout that kills everything the program
  started, and a clean environment (no parent variables, so no secrets);
- when running as root: a fresh unprivileged uid/gid per run (cannot signal
  the parent, cannot write files it does not own, per-run process accounting);
- Linux namespaces: network (only a down loopback device), mount (read-only
  view of the host, private size-capped scratch tmpfs at /tmp), pid (the
  program sees only its own processes; all die with it) and IPC.

Setup happens in a small launcher process (`launcher.py`, run as a script) so
the parent never forks with `preexec_fn`, which is unsafe in a threaded
process. Which namespaces work is probed once per process; if network
isolation is unavailable, one warning says so and `network_isolated` is False.

This package imports only the standard library: the launcher runs with `python -I -S`.
"""

import dataclasses
from typing import Any

from glmlight.rewards.sandbox.config import SandboxConfig, SandboxError, SandboxResult
from glmlight.rewards.sandbox.probe import available_namespaces
from glmlight.rewards.sandbox.procfs import kill_uid, processes_of_uid, tasks_of_uid
from glmlight.rewards.sandbox.supervisor import run_once

__all__ = ["SandboxConfig", "SandboxError", "SandboxResult", "available_namespaces", "kill_uid",
           "processes_of_uid", "run_sandboxed", "tasks_of_uid"]


def run_sandboxed(code: str, stdin: str = "", *, config: SandboxConfig | None = None, **overrides: Any) -> SandboxResult:
    """Run Python `code` with `stdin` in the sandbox; keyword overrides replace `config` fields.

    A failing, hostile or runaway program is reported in the result; only a
    broken sandbox (cannot spawn, setup failed) raises `SandboxError`.
    """
    cfg = dataclasses.replace(config or SandboxConfig(), **overrides)
    namespaces = available_namespaces(cfg)
    if cfg.require_network_isolation and "net" not in namespaces:
        raise SandboxError("network isolation is required but unavailable on this machine")
    return run_once(code, stdin, cfg, namespaces)


# ---------------------------------------------------------------------------------------------
# Probe: which namespaces work here (once per process and interpreter)
