"""What a sandboxed run is given (`SandboxConfig`) and what it reports (`SandboxResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
FULL_NAMESPACES = ("net", "mount", "pid", "ipc")
# Tried in order by the probe; the first that runs a program wins.
NAMESPACE_CANDIDATES: tuple[tuple[str, ...], ...] = (FULL_NAMESPACES, ("net",), ())

_PROBE_PROGRAM = "import socket\nnames = [n for _, n in socket.if_nameindex()]\nassert names == ['lo'], names\n"


class SandboxError(RuntimeError):
    """The sandbox itself is broken (cannot spawn or set up), as opposed to a failing program."""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and isolation switches for one sandboxed run; every field has a sane default."""

    timeout_s: float = 5.0  # wall clock, from spawn to kill
    cpu_s: int = 5  # RLIMIT_CPU: SIGXCPU at cpu_s, SIGKILL one second later
    memory_mb: int = 512  # RLIMIT_AS (virtual address space)
    file_size_mb: int = 16  # RLIMIT_FSIZE: largest file the program may write
    max_procs: int = 32  # RLIMIT_NPROC (processes + threads of the sandbox uid)
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 1 << 20  # kept per stream; the rest is read and discarded
    scratch_mb: int = 64  # size of the private /tmp tmpfs (mount namespace only)
    namespaces: bool = True  # use net/mount/pid/ipc namespaces where they work
    drop_privileges: bool = True  # when root, run as a fresh unprivileged uid
    require_network_isolation: bool = False  # raise SandboxError instead of running without it
    uid_range: tuple[int, int] = (1_000_000, 2_000_000)  # uids/gids drawn for runs (root only)
    python: str | None = None  # interpreter for the program; default: this one
    workdir_root: str | None = None  # parent of the per-run temp dir; default: tempfile's


@dataclass
class SandboxResult:
    """What a sandboxed run did. `returncode` < 0 means killed by that signal (like subprocess)."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    killed_by_signal: int | None
    duration_s: float
    network_isolated: bool
    violations: list[str] = field(default_factory=list)
    output_truncated: bool = False
    isolation: tuple[str, ...] = ()  # active layers: "uid", "net", "mount", "pid", "ipc"
    uid: int | None = None  # the unprivileged uid the program ran as (None: the caller's)

    @property
    def ok(self) -> bool:
        """Exited 0 within every limit."""
        return self.returncode == 0 and not self.timed_out and not self.output_truncated
