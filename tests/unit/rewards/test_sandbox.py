"""The code sandbox against hostile programs, and CodeReward on good and bad programs.

Every hostile program must be contained (scored as a failure, nothing left
running, the test process untouched). Hostile cases use short limits so the
file stays fast on two cores.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import shutil
import socket
import tempfile
import uuid

import pytest

from glmlight.rewards.sandbox import probe as sandbox_probe
from glmlight.rewards.base import score_samples
from glmlight.rewards.code import CodeReward, extract_code, outputs_match
from glmlight.rewards.sandbox import (
    SandboxConfig,
    SandboxError,
    available_namespaces,
    processes_of_uid,
    run_sandboxed,
)
from glmlight.sample import Sample, Status

HOSTILE = SandboxConfig(timeout_s=2.0, cpu_s=1)
IS_ROOT = os.geteuid() == 0
# A world-readable interpreter lets the no-namespace fallback run as an unprivileged uid.
SYSTEM_PYTHON = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None)


def run(code: str, stdin: str = "", **overrides):
    return run_sandboxed(code, stdin, config=HOSTILE, **overrides)


def assert_contained(res) -> None:
    """A failure of the program, inside its limits, with nothing left behind."""
    assert not res.ok, res
    assert res.duration_s < HOSTILE.timeout_s + 3.0
    if res.uid is not None:
        assert processes_of_uid(res.uid) == []
    os.kill(os.getpid(), 0)  # still here


def fallback_overrides() -> dict:
    """Run without namespaces (the uid layer alone); skip where that cannot be exercised."""
    if not IS_ROOT or SYSTEM_PYTHON is None:
        pytest.skip("the no-namespace fallback is exercised as root with a world-readable interpreter")
    return {"namespaces": False, "python": SYSTEM_PYTHON}


MODES = ["namespaces", "uid_only"]


def mode_overrides(mode: str) -> dict:
    return {} if mode == "namespaces" else fallback_overrides()


@pytest.fixture
def open_dir():
    """A root-owned 0755 directory under /tmp: reachable by the sandbox, not writable by it."""
    path = tempfile.mkdtemp(prefix="glmlight-test-")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Hostile programs


@pytest.mark.parametrize("mode", MODES)
def test_fork_bomb_is_contained(mode):
    res = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", **mode_overrides(mode))
    assert_contained(res)
    assert res.timed_out or res.returncode != 0


def test_memory_bomb_is_contained():
    res = run("x = bytearray(10 * 1024 ** 3)\nprint(len(x))\n")
    assert_contained(res)
    assert "memory" in res.violations
    # Growing to the address-space limit zero-fills every page it gets: about 0.3 s of CPU on a quiet
    # machine, over the hostile 1 s on a loaded one. A looser CPU budget keeps the memory limit the one hit.
    grow = run("chunks = []\nwhile True:\n    chunks.append(bytearray(64 * 1024 * 1024))\n", memory_mb=256, cpu_s=4, timeout_s=4.0)
    assert_contained(grow)
    assert "memory" in grow.violations


def test_infinite_loop_hits_the_wall_clock_timeout():
    res = run("import time\nwhile True:\n    time.sleep(1)\n")
    assert_contained(res)
    assert res.timed_out and "timeout" in res.violations


def test_cpu_burner_hits_the_cpu_limit():
    res = run("while True:\n    pass\n", timeout_s=5.0)
    assert_contained(res)
    assert not res.timed_out
    assert "cpu_time" in res.violations


@pytest.mark.parametrize("mode", MODES)
def test_writing_outside_the_workdir_fails(open_dir, mode):
    target = os.path.join(open_dir, "pwned")
    scratch_leak = os.path.join("/tmp", f"glmlight-leak-{uuid.uuid4().hex}")
    program = (
        f"for path in {[target, scratch_leak]!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print('denied', path, e.errno)\n"
        "open('inside.txt', 'w').write('fine')\n"
        "raise SystemExit(3)\n"
    )
    try:
        res = run(program, **mode_overrides(mode))
        assert res.returncode == 3, res
        assert f"denied {target}" in res.stdout
        assert not os.path.exists(target), "the sandbox wrote into a directory it does not own"
        # With a mount namespace /tmp is private; without one the uid's leftovers are deleted afterwards.
        assert not os.path.exists(scratch_leak), "a file written to /tmp outlived the run"
    finally:
        if os.path.exists(scratch_leak):
            os.unlink(scratch_leak)


def test_network_connection_to_loopback_never_arrives():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        program = (
            "import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "s.sendall(b'leak')\n"
            "print('connected')\n"
        )
        res = run(program)
        server.settimeout(0.3)
        if not res.network_isolated:
            pytest.skip("network isolation unavailable on this machine: the connection may arrive")
        assert_contained(res)
        assert "connected" not in res.stdout
        assert "network" in res.violations
        with pytest.raises(socket.timeout):
            server.accept()


@pytest.mark.parametrize("mode", MODES)
def test_parent_environment_secrets_do_not_leak(monkeypatch, mode):
    monkeypatch.setenv("GLMLIGHT_TEST_SECRET", "s3cret")
    program = (
        "import os\n"
        "print(dict(os.environ))\n"
        f"for pid in (os.getppid(), {os.getpid()}):\n"
        "    try:\n"
        "        print(open(f'/proc/{pid}/environ').read())\n"
        "    except OSError:\n"
        "        print('environ-denied', pid)\n"
        "raise SystemExit(2)\n"
    )
    res = run(program, **mode_overrides(mode))
    assert res.returncode == 2, res
    assert "s3cret" not in res.stdout + res.stderr
    assert "GLMLIGHT_TEST_SECRET" not in res.stdout
    assert f"environ-denied {os.getpid()}" in res.stdout


@pytest.mark.parametrize("mode", MODES)
def test_killing_the_parent_fails(mode):
    overrides = mode_overrides(mode)
    can_isolate = IS_ROOT or "pid" in available_namespaces(HOSTILE)
    if mode == "namespaces" and not can_isolate:
        pytest.skip("neither an unprivileged uid nor a pid namespace: the program could signal the caller")
    me = os.getpid()
    program = (
        "import os, signal\n"
        f"for target in (os.getppid(), {me}, -1):\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "        print('sent', target)\n"
        "    except OSError as e:\n"
        "        print('denied', target, e.errno)\n"
        "raise SystemExit(5)\n"
    )
    res = run(program, **overrides)
    os.kill(me, 0)  # the test process survived
    assert res.returncode in (5, -9), res
    assert f"sent {me}" not in res.stdout


def test_cannot_regain_root():
    if not IS_ROOT:
        pytest.skip("only meaningful when the caller is root")
    res = run("import os\ntry:\n    os.setuid(0)\n    print('root again')\nexcept OSError:\n    print('denied')\n")
    assert "denied" in res.stdout and "root again" not in res.stdout


def test_huge_output_is_truncated_without_memory_blowup():
    before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    program = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)\n"
    res = run(program, timeout_s=15.0, cpu_s=10)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kb) / 1024
    assert len(res.stdout) <= HOSTILE.max_output_bytes
    assert res.output_truncated and "output_size" in res.violations
    assert not res.ok
    assert grown_mb < 64, f"parent memory grew by {grown_mb:.0f} MB"


@pytest.mark.parametrize("program", ["open('f.txt', 'w').write('x' * 1000)\n", "import time\ntime.sleep(60)\n"])
def test_workdir_is_removed_afterwards(open_dir, program):
    res = run(program, workdir_root=open_dir)
    assert os.listdir(open_dir) == [], res


def test_broken_sandbox_raises():
    with pytest.raises(SandboxError):
        run("print(1)\n", python="/nonexistent/python3")


def test_unavailable_isolation_falls_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_probe, "NAMESPACE_CANDIDATES", (("net", "no-such-namespace"), ()))
    monkeypatch.setattr(sandbox_probe, "_probe_cache", {})
    monkeypatch.setattr(sandbox_probe, "_warned", False)
    python = fallback_overrides()["python"] if IS_ROOT else None  # reachable without a mount namespace
    with caplog.at_level(logging.WARNING, logger="glmlight.rewards.sandbox"):
        assert available_namespaces(dataclasses.replace(HOSTILE, python=python)) == frozenset()
        res = run("print('ran')\n", python=python)
        assert available_namespaces(dataclasses.replace(HOSTILE, python=python)) == frozenset()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "network isolation is unavailable" in warnings[0].getMessage()
    assert res.ok and not res.network_isolated
    with pytest.raises(SandboxError, match="network isolation is required"):
        run("print('ran')\n", python=python, require_network_isolation=True)


# ---------------------------------------------------------------------------------------------
# CodeReward


def decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8")


def make_sample(text: str, **metadata) -> Sample:
    ids = list(text.encode("utf-8"))
    n = len(ids)
    return Sample(prompt_ids=[1], response_ids=ids, loss_mask=[1] * n, rollout_logprobs=[0.0] * n, versions=[0] * n, metadata=metadata)


ADD_TESTS = [
    {"input": "1 2\n", "output": "3\n"},
    {"input": "5 7\n", "output": "12"},
    {"input": "40 2\n", "output": "42\n"},
]


def completion(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}```\nIt reads two numbers."


@pytest.fixture(scope="module")
def reward():
    fn = CodeReward(decode, config=SandboxConfig(timeout_s=5.0))
    yield fn
    fn.close()


def test_correct_program_scores_one(reward):
    value, info = reward(make_sample(completion("a, b = map(int, input().split())\nprint(a + b)\n"), tests=ADD_TESTS))
    assert value == 1.0
    assert info["passed"] == info["total"] == 3


def test_wrong_program_scores_zero(reward):
    value, info = reward(make_sample(completion("a, b = map(int, input().split())\nprint(a - b)\n"), tests=ADD_TESTS))
    assert value == 0.0
    assert [t["passed"] for t in info["tests"]] == [False, False, False]


def test_partial_credit_and_all_or_nothing(reward):
    code = "a, b = map(int, input().split())\nprint(a + b if a < 10 else 0)\n"
    value, info = reward(make_sample(completion(code), tests=ADD_TESTS))
    assert value == pytest.approx(2 / 3)
    assert [t["passed"] for t in info["tests"]] == [True, True, False]
    strict = CodeReward(decode, all_or_nothing=True)
    try:
        assert strict(make_sample(completion(code), tests=ADD_TESTS))[0] == 0.0
    finally:
        strict.close()


def test_test_code_asserts(reward):
    code = "def square(x):\n    return x * x\n"
    good, _ = reward(make_sample(completion(code), test_code="assert square(3) == 9\nassert square(-2) == 4\n"))
    bad, info = reward(make_sample(completion(code), test_code="assert square(3) == 10\n"))
    assert (good, bad) == (1.0, 0.0)
    assert "AssertionError" in info["tests"][0]["stderr_tail"]


def test_completion_text_from_metadata_without_decode():
    fn = CodeReward(config=SandboxConfig(timeout_s=5.0))
    try:
        sample = make_sample("ignored", completion_text="print(int(input()) * 2)", tests=[{"input": "21", "output": "42"}])
        assert fn(sample)[0] == 1.0
    finally:
        fn.close()


def test_hostile_program_is_scored_zero_not_failed():
    fn = CodeReward(decode, config=HOSTILE)
    try:
        samples = [make_sample(completion("import time\nwhile True:\n    time.sleep(1)\n"), tests=ADD_TESTS[:1])]
        counts = score_samples(fn, samples)
    finally:
        fn.close()
    assert counts["scored"] == 1 and counts["failed"] == 0
    assert samples[0].status is not Status.FAILED
    assert samples[0].reward == 0.0
    assert "timeout" in samples[0].metadata["reward_info"]["violations"]


def test_missing_tests_or_broken_sandbox_count_as_reward_failures():
    broken = CodeReward(decode, config=SandboxConfig(python="/nonexistent/python3"))
    try:
        samples = [make_sample(completion("print(1)\n")), make_sample(completion("print(1)\n"), tests=ADD_TESTS[:1])]
        counts = score_samples(broken, samples)
    finally:
        broken.close()
    assert counts["failed"] == 2
    assert all(s.status is Status.FAILED for s in samples)


def test_extract_code_and_output_matching():
    assert extract_code("x\n```python\nprint(1)\n```\ny\n```python\nprint(2)\n```") == "print(2)\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("```text\nnot code\n```\n```py\nprint(4)\n```") == "print(4)\n"
    assert extract_code("print(5)") == "print(5)"
    assert outputs_match("1 2  \n3\n\n", "1 2\n3")
    assert not outputs_match("1 2\n", "1 3\n")
