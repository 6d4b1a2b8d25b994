"""Which namespaces work on this machine: probed once per process and interpreter, by running a
program under each candidate set (the first that runs wins); one warning when isolation is weaker."""

from __future__ import annotations

import dataclasses
import logging
import threading

from glmlight.rewards.sandbox.config import (
    _PROBE_PROGRAM,
    FULL_NAMESPACES,
    NAMESPACE_CANDIDATES,
    SandboxConfig,
    SandboxError,
)
from glmlight.rewards.sandbox.supervisor import (
    interpreter,
    run_once,
    will_drop_privileges,
)

log = logging.getLogger("glmlight.rewards.sandbox")

_probe_lock = threading.Lock()
_probe_cache: dict[tuple, tuple[frozenset[str] | None, str]] = {}
_warned = False


def available_namespaces(cfg: SandboxConfig | None = None) -> frozenset[str]:
    """The namespaces runs will use; probed once and cached. Raises SandboxError if nothing runs."""
    cfg = cfg or SandboxConfig()
    if not cfg.namespaces:
        return frozenset()
    key = (interpreter(cfg), will_drop_privileges(cfg), cfg.workdir_root)
    with _probe_lock:
        if key not in _probe_cache:
            _probe_cache[key] = _probe(cfg)
        found, reasons = _probe_cache[key]
    if found is None:
        raise SandboxError(f"cannot run a sandboxed program on this machine: {reasons}")
    return found


def _probe(cfg: SandboxConfig) -> tuple[frozenset[str] | None, str]:
    probe_cfg = dataclasses.replace(cfg, timeout_s=max(cfg.timeout_s, 20.0), cpu_s=max(cfg.cpu_s, 10))
    reasons: list[str] = []
    for candidate in NAMESPACE_CANDIDATES:
        program = _PROBE_PROGRAM if "net" in candidate else "pass\n"
        try:
            res = run_once(program, "", probe_cfg, frozenset(candidate))
        except SandboxError as e:
            reasons.append(f"[{'+'.join(candidate) or 'no namespaces'}] {e}")
            continue
        if res.returncode == 0:
            _warn_once(frozenset(candidate), reasons)
            return frozenset(candidate), ""
        tail = res.stderr.strip().splitlines()[-1:] or [f"exit {res.returncode}"]
        reasons.append(f"[{'+'.join(candidate) or 'no namespaces'}] {tail[0]}")
    return None, "; ".join(reasons)


def _warn_once(found: frozenset[str], reasons: list[str]) -> None:
    global _warned
    missing = [ns for ns in FULL_NAMESPACES if ns not in found]
    if not missing or _warned:
        return
    _warned = True
    if "net" in missing:
        what = "network isolation is unavailable: sandboxed programs CAN open network connections"
    else:
        what = f"{'/'.join(missing)} namespaces are unavailable: weaker filesystem/process isolation"
    log.warning("code sandbox: %s (%s)", what, "; ".join(reasons) or "probe failed")
