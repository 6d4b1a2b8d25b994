"""The sandbox launcher: run as `python -I -S -B launcher.py SPEC` by the supervisor, it sets the
sandbox up (namespaces, mounts, identity, limits) and then execs the program. Any setup error is
written to the status pipe (closed on a successful exec) and exits 127.

Standard library only: it runs in isolated mode, without glmlight or site-packages on the path.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import resource
import signal
import sys
from typing import Any

PROGRAM_NAME = "main.py"
# World-writable scratch directories that the mount namespace replaces with the private tmpfs.
SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")

# Any setup error is written to the status pipe (closed on a successful exec) and exits 127.

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
# Per-mount flags a read-only remount must keep (they may be locked); equal to statvfs ST_* bits.
_KEEP_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | 4096  # + NOATIME, NODIRATIME, RELATIME
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
_NS_FLAGS = {"net": CLONE_NEWNET, "mount": CLONE_NEWNS, "pid": CLONE_NEWPID, "ipc": CLONE_NEWIPC}

_libc: Any = None


def _syscall(name: str, *args: Any) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if getattr(_libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}{args!r}: {os.strerror(err)}")


def _c_str(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _syscall("mount", _c_str(source), _c_str(target), _c_str(fstype), ctypes.c_ulong(flags), _c_str(data))


def _prctl(option: int, value: int) -> None:
    _syscall("prctl", option, ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


def _launcher_main(spec: dict[str, Any]) -> None:
    status_fd = spec["status_fd"]
    os.set_inheritable(status_fd, False)
    try:
        _launch(spec, status_fd)
    except BaseException as e:  # noqa: BLE001 - report every setup failure to the parent
        os.write(status_fd, f"{type(e).__name__}: {e}".encode()[:4000])
        os._exit(127)


def _launch(spec: dict[str, Any], status_fd: int) -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the supervising parent
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    namespaces = set(spec["namespaces"])
    program = _read_program(spec)
    if namespaces:
        _enter_namespaces(namespaces)
    if "pid" in namespaces:
        _spawn_in_pid_namespace(spec, status_fd, program)  # returns only in the program's process
    else:
        if "mount" in namespaces:
            _setup_mounts(spec, program, new_proc=False)
        _become_sandboxed(spec)
        _exit_if_orphaned(spec)
    os.execve(spec["python"], spec["argv"], spec["env"])


def _read_program(spec: dict[str, Any]) -> bytes:
    with open(os.path.join(spec["workdir"], PROGRAM_NAME), "rb") as f:
        return f.read()


def _enter_namespaces(namespaces: set[str]) -> None:
    flags = 0
    for ns in namespaces:
        flags |= _NS_FLAGS[ns]
    if os.geteuid() == 0:
        _syscall("unshare", flags)
        return
    uid, gid = os.getuid(), os.getgid()  # unprivileged: a user namespace mapping us to ourselves
    _syscall("unshare", flags | CLONE_NEWUSER)
    for path, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{path}", "w") as f:
            f.write(text)


def _spawn_in_pid_namespace(spec: dict[str, Any], status_fd: int, program: bytes) -> None:
    """launcher (relay) -> init (pid 1: mounts, reaps) -> program. Returns in the program's process.

    The program is not pid 1, so kernel signals such as SIGXCPU reach it; when
    it exits, init exits and the kernel kills whatever is left in the namespace.
    """
    report_r, report_w = os.pipe()  # init -> relay: the program's wait status
    alive_r, alive_w = os.pipe()  # relay -> init: EOF once the relay is gone
    if os.fork():
        os.close(status_fd)
        os.close(report_w)
        os.close(alive_r)
        _relay_exit(report_r)
    os.close(report_r)
    os.close(alive_w)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if _pipe_closed(alive_r):  # the relay died before the death signal was armed
        os._exit(1)
    if "mount" in spec["namespaces"]:
        _setup_mounts(spec, program, new_proc=True)
    child = os.fork()
    if child == 0:
        os.close(report_w)
        os.close(alive_r)
        _become_sandboxed(spec)
        return
    os.close(status_fd)
    _reap_until(child, report_w)


def _pipe_closed(fd: int) -> bool:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 1) == b""
    except BlockingIOError:
        return False


def _reap_until(child: int, report_w: int) -> None:
    """As init: reap every orphan; when the program exits, report its status and exit."""
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            os.write(report_w, str(status).encode())
            os._exit(0)


def _relay_exit(report_r: int) -> None:
    """Wait for init and leave the way the program did (its signal or its exit code)."""
    _, status = os.wait()
    report = os.read(report_r, 64)
    if report:
        status = int(report)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _setup_mounts(spec: dict[str, Any], program: bytes, new_proc: bool) -> None:
    """Private, read-only view of the host; a size-capped tmpfs for every scratch dir; own /proc."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    if spec["expose"]:
        _expose_prefix(*spec["expose"])
    uid = spec["uid"] if spec["uid"] is not None else os.getuid()
    gid = spec["uid"] if spec["uid"] is not None else os.getgid()
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['scratch_mb']}m,mode=0700,uid={uid},gid={gid}")
    path = os.path.join("/tmp", PROGRAM_NAME)
    with open(path, "wb") as f:
        f.write(program)
    os.chown(path, uid, gid)
    scratch = ["/tmp"]
    for d in SCRATCH_DIRS[1:]:
        if os.path.isdir(d) and not os.path.islink(d):
            _mount("/tmp", d, None, MS_BIND)
            scratch.append(d)
    _remount_all_readonly(skip=set(scratch))
    if new_proc:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def _expose_prefix(mask: str, prefix: str) -> None:
    """Cover `mask` with an empty tmpfs and bind only the interpreter `prefix` back into it."""
    fd = os.open(prefix, os.O_PATH | os.O_DIRECTORY)
    try:
        _mount("tmpfs", mask, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        os.makedirs(prefix, mode=0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", prefix, None, MS_BIND | MS_REC)
    finally:
        os.close(fd)


def _mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            raw = line.split()[4]
            points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), raw))  # e.g. \040
    return points


def _remount_all_readonly(skip: set[str]) -> None:
    for point in _mount_points():
        if point in skip:
            continue
        keep = os.statvfs(point).f_flag & _KEEP_FLAGS
        _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)


def _become_sandboxed(spec: dict[str, Any]) -> None:
    """Limits, the unprivileged identity, no privilege gain, default signals, the program's cwd."""
    for res, soft, hard in spec["rlimits"]:
        resource.setrlimit(res, (soft, hard))
    if spec["uid"] is not None:
        os.setgroups([])
        os.setresgid(spec["uid"], spec["uid"], spec["uid"])
        os.setresuid(spec["uid"], spec["uid"], spec["uid"])
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(spec["cwd"])


def _exit_if_orphaned(spec: dict[str, Any]) -> None:
    """Re-arm the death signal (a credential change cleared it) and close the race with the parent."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != spec["ppid"]:
        os._exit(1)


if __name__ == "__main__":
    _launcher_main(json.loads(sys.argv[1]))
