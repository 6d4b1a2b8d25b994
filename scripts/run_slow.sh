#!/usr/bin/env bash
# Every slow test (marked `slow`: kept out of the default `python -m pytest`), run from the repository root:
#
#   scripts/run_slow.sh                          # all of them
#   scripts/run_slow.sh tests/system -k learning -s   # any pytest arguments narrow the run
#
# The real-server tests get their interpreters as the README's test command gives them:
# GLMLIGHT_VLLM_PYTHON and GLMLIGHT_SGLANG_PYTHON from scripts/vllm_cpu_venv.sh and
# scripts/sglang_cpu_venv.sh (each environment built once, reused after). A variable already set is
# passed through as it is. A failed build leaves the variable empty, which the real-server tests report
# as a failure, not a skip.
set -euo pipefail
cd "$(dirname "$0")/.."
export GLMLIGHT_VLLM_PYTHON=${GLMLIGHT_VLLM_PYTHON-$(scripts/vllm_cpu_venv.sh | tail -1)}
export GLMLIGHT_SGLANG_PYTHON=${GLMLIGHT_SGLANG_PYTHON-$(scripts/sglang_cpu_venv.sh | tail -1)}
exec python -m pytest -m slow "$@"
