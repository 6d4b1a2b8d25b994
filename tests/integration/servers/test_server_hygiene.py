"""No server glmlight launched outlives the run, whichever way the run ends: fit() returns, raises, the
process gets SIGINT or SIGTERM, or it is killed outright (SIGKILL, which no handler sees). Each test
runs a managed stand-in server (tests/support/protocol_servers.py: it starts a child process of its own, as
real servers do) and then scans /proc for any process left with the run's marker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import lightning.pytorch as pl
import pytest

import glmlight
from glmlight.engines.servers.launch import SERVER_ID_ENV, processes_with_env, server_processes
from tests.support.waiting import running, wait_until
from tests.conftest import REPO, newest_pushed_version, overrides_for_tests
from tests.support.protocol_servers import standin_script


def _tagged(tag: str) -> list[int]:
    """Live processes whose environment carries GLMLIGHT_TEST_TAG=tag (a run and all it started)."""
    return processes_with_env("GLMLIGHT_TEST_TAG", tag)


def _gone(find) -> list[int]:
    """Wait until `find()` lists no process (a process left behind hangs here until pytest-timeout)."""
    wait_until(lambda: not find(), what="the processes to exit", poll_s=0.2)
    return find()


def _overrides(tmp_path, *extra: str) -> list[str]:
    cmd = f"[{sys.executable},{standin_script(tmp_path, 'sglang')}]"
    return overrides_for_tests(tmp_path, "rollout=sglang", "rollout.server.urls=[]", "rollout.server.launch=true",
                               f"rollout.server.launch_command={cmd}", "rollout.server.launch_timeout_s=900",
                               "rollout.server.api_key_env=null", f"rollout.server.weight_sync_dir={tmp_path}/weights",
                               f"rollout.server.model_path={tmp_path}",
                               "~callbacks.held_out_eval", "~callbacks.sample_table", *extra)


class Boom(pl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        raise RuntimeError("boom in a callback")


@pytest.mark.parametrize("ending", ["returns", "raises"])
def test_fit_closes_the_managed_server(tmp_path, ending):
    run = glmlight.build(glmlight.compose(_overrides(tmp_path, "trainer.max_steps=1")))
    server_id = run.datamodule.engine.launcher.server_id
    assert len(server_processes(server_id)) >= 3  # guard, server, the server's own child
    if ending == "raises":
        run.trainer.callbacks.append(Boom())
        with pytest.raises(RuntimeError, match="boom"):
            run.fit()
    else:
        run.fit()
        assert run.module.policy_version == 1
    assert server_processes(server_id) == []


@pytest.mark.parametrize("sig", [pytest.param(signal.SIGINT, marks=pytest.mark.slow), signal.SIGTERM])
def test_train_py_killed_by_a_signal_leaves_no_server(tmp_path, sig):
    tag = uuid.uuid4().hex
    log = tmp_path / "train.log"
    env = {**os.environ, "GLMLIGHT_TEST_TAG": tag, "PYTHONPATH": REPO}
    with open(log, "wb") as out:
        # SIGINT at its default disposition in the child: a shell's background job (`cmd &`) starts with
        # SIGINT ignored, which Python then keeps, and the signal would change nothing
        proc = subprocess.Popen([sys.executable, os.path.join(REPO, "scripts", "train.py"),
                                 *_overrides(tmp_path, "trainer.max_steps=100000", "logger=none")],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # until it has trained a step against its server and pushed the weights
        wait_until(lambda: newest_pushed_version(tmp_path / "weights") >= 1, alive=running(proc), poll_s=0.3,
                   what=f"a pushed weight version ({log.read_text()[-2000:]})")
        proc.send_signal(sig)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _gone(lambda: _tagged(tag)) == [], log.read_text()[-2000:]
    # Ctrl-C ends the run with an error code; SIGTERM with a graceful stop and 128 + 15, as a killed process
    assert proc.returncode != 0 if sig == signal.SIGINT else proc.returncode == 143


def test_a_killed_parent_takes_its_server_along(tmp_path):
    """SIGKILL runs no handler and no atexit: the guard sees the trainer's pipe close and stops the
    server's whole process group."""
    tag = uuid.uuid4().hex
    code = f"""
import os, signal, sys
sys.path.insert(0, {REPO!r})
from glmlight.engines.factory import build_server_engine
from tests.support.protocol_servers import launch_config, standin_script
import pathlib
tmp = pathlib.Path({str(tmp_path)!r})
eng = build_server_engine(launch_config(tmp, "sglang", [sys.executable, standin_script(tmp, "sglang")]))
print(eng.launcher.server_id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "GLMLIGHT_TEST_TAG": tag, "PYTHONPATH": REPO})
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    server_id = out.stdout.split()[-1]
    assert _gone(lambda: server_processes(server_id)) == [] and _gone(lambda: _tagged(tag)) == []


@pytest.mark.slow
def test_killing_the_guard_still_stops_the_server(tmp_path):
    """PR_SET_PDEATHSIG: the server gets SIGTERM when its guard dies, and stops its own child."""
    from glmlight.engines.factory import build_server_engine
    from tests.support.protocol_servers import launch_config

    eng = build_server_engine(launch_config(tmp_path, "sglang", [sys.executable, standin_script(tmp_path, "sglang")]))
    try:
        server_id = eng.launcher.server_id
        assert SERVER_ID_ENV in os.environ or len(server_processes(server_id)) >= 3
        os.kill(eng.launcher.proc.pid, signal.SIGKILL)
        eng.launcher.proc.wait()
        assert _gone(lambda: server_processes(server_id)) == []
    finally:
        eng.close()
