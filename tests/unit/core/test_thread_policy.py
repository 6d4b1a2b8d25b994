"""Importing glmlight before torch makes idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE) unless the
user chose a policy; importing it after torch changes nothing (OpenMP has read the variable already)."""

import os
import subprocess
import sys

import pytest

PROBE = "import os, {first}; import torch; print(os.environ.get('OMP_WAIT_POLICY'))"


@pytest.mark.parametrize("first, preset, want", [("glmlight", None, "PASSIVE"), ("glmlight", "ACTIVE", "ACTIVE"),
                                                 ("torch, glmlight", None, "None")])
def test_the_openmp_wait_policy(first, preset, want):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if preset:
        env["OMP_WAIT_POLICY"] = preset
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == want
