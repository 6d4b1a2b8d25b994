"""The guard a managed server runs under (standard library only; run as a script; glmlight imports
only its process-group scan, `group_processes`):

    python guard.py <watch-fd> <grace-seconds> -- <server command...>

It leads its own process group (the launcher starts it with `start_new_session`), starts the server
in that group with `PR_SET_PDEATHSIG = SIGTERM` (Linux), and stops the whole group — the server
and every process the server started (vLLM's engine core and workers, SGLang's schedulers) —
when any of these happens:

- the trainer process dies, however it dies (SIGKILL included): `watch-fd` is the read end of a
  pipe whose write end only the trainer holds, so it reads EOF;
- the guard gets SIGTERM, SIGINT or SIGHUP (what `ManagedServer.stop()` sends);
- the server exits on its own (its leftover children are stopped too).

Stopping is SIGTERM to the group, then SIGKILL after `grace-seconds`. The guard exits with the
server's exit code (128 + N when the server died of signal N); if the guard itself is killed,
the server still gets SIGTERM from PR_SET_PDEATHSIG.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


def _set_pdeathsig() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the pipe and the process group still work
        pass


def group_processes(pgid: int) -> list[int]:
    """The live processes (zombies excluded) of process group `pgid`; Linux /proc, [] elsewhere. Finds
    a process that renamed itself (the routers call setproctitle, which overwrites /proc/<pid>/environ)."""
    out = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry))
    return out


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # The guard itself is in the group: alive means another member exists.
    return any(pid != os.getpid() for pid in group_processes(pgid))


def _stop(pgid: int, grace: float) -> None:
    """SIGTERM to the group (the guard's own handler then finds the stop under way), SIGKILL to
    whatever is left after `grace`."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _group_alive(pgid):
        time.sleep(0.1)
    if _group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)  # the guard included: nothing of the group survives


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: guard.py WATCH_FD GRACE_S -- COMMAND...", file=sys.stderr)
        return 2
    watch_fd, grace = int(argv[0]), float(argv[1])
    command = argv[3:]
    pgid = os.getpgrp()
    stopping, stopped = threading.Event(), threading.Event()

    def stop_group(*_: object) -> None:
        if stopping.is_set():
            stopped.wait()
            return
        stopping.set()
        try:
            _stop(pgid, grace)
        finally:
            stopped.set()

    try:
        child = subprocess.Popen(command, preexec_fn=_set_pdeathsig)
    except OSError as e:
        print(f"cannot start {command[0]}: {e}", file=sys.stderr, flush=True)
        return 127
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: threading.Thread(target=stop_group, daemon=True).start())

    def watch() -> None:
        try:
            while os.read(watch_fd, 1024):
                pass
        except OSError:
            pass
        stop_group()  # the trainer is gone

    threading.Thread(target=watch, daemon=True).start()
    while True:
        try:
            rc = child.wait()
            break
        except InterruptedError:
            continue
    stop_group()  # the server's own children, if it left any
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
