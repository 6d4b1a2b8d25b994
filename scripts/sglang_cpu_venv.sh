#!/usr/bin/env bash
# Build, or reuse when it is already there, a virtual environment outside the repository with SGLang
# 0.5.23 for CPU, for the tests that run a real SGLang server on this machine:
#
#   scripts/sglang_cpu_venv.sh [DIR]  # default: $GLMLIGHT_SGLANG_VENV, else ~/.cache/glmlight/sglang-cpu-0.5.23
#   export GLMLIGHT_SGLANG_PYTHON=$(scripts/sglang_cpu_venv.sh | tail -1)
#
# The last line printed is the environment's interpreter. glmlight itself is not installed there.
# The server is started with SGLANG_USE_CPU_ENGINE=1 --device cpu --attention-backend torch_native
# (glmlight's real-server tests do; docs/servers.md). What the sglang 0.5.23 wheel needs here:
# - its metadata pins torch 2.14.1 and CUDA-only packages (flashinfer, sglang-kernel, flash-attn,
#   deep-gemm, ...): the wheel is installed with --no-deps, then its other dependencies at the versions
#   it pins, with a constraint that keeps torch at 2.13.0 (the CPU build, as the vLLM environment);
# - sgl_kernel: no CPU build exists on the registry; SGLang's CPU engine imports some of its names at
#   load time, none of which is called on this path. scripts/sglang_cpu/sgl_kernel is an import shim
#   that defines them and raises if called (its docstring says why);
# - torchvision: SGLang imports it at start-up in two image-model modules; the registry's torchvision
#   wheels are built against CUDA torch and fail to import beside torch 2.13.0+cpu (`operator
#   torchvision::nms does not exist`). It is left out, and scripts/sglang_cpu/guard_torchvision.py
#   wraps those two modules' torchvision imports in try/except ImportError (its docstring says why).
set -euo pipefail
VERSION=0.5.23
HERE="$(cd "$(dirname "$0")" && pwd)"
DIR=${1:-${GLMLIGHT_SGLANG_VENV:-$HOME/.cache/glmlight/sglang-cpu-$VERSION}}
PY="$DIR/bin/python"
# This script and the shim are part of the environment: a change to either rebuilds it.
STAMP="$VERSION $(cat "$0" "$HERE"/sglang_cpu/*.py "$HERE"/sglang_cpu/*/*.py | sha256sum | cut -c1-16)"
check() { SGLANG_USE_CPU_ENGINE=1 "$PY" -c "import sglang, sglang.launch_server; assert sglang.__version__ == '$VERSION', sglang.__version__" >/dev/null 2>&1; }
installed() { "$PY" -c "import importlib.metadata as m; assert m.version('sglang') == '$VERSION'" >/dev/null 2>&1; }
# SGLang's own router (a Rust load balancer from the package registry; rollout.server.router=sglang-router)
ROUTER=sglang-router==0.3.2
router() { "$PY" -m pip show sglang-router 2>/dev/null | grep -q "^Version: ${ROUTER#*==}$" || "$PY" -m pip install -q "$ROUTER"; }
if [ -f "$DIR/.glmlight-ready" ] && [ "$(cat "$DIR/.glmlight-ready")" = "$STAMP" ] && installed; then
  echo "sglang $VERSION CPU environment: reusing $DIR" >&2
  router
  echo "$PY"
  exit 0
fi
echo "sglang $VERSION CPU environment: building $DIR (about 10 minutes)" >&2
start=$(date +%s)
rm -rf "$DIR"
mkdir -p "$(dirname "$DIR")"
python -m venv "$DIR"
export PIP_DISABLE_PIP_VERSION_CHECK=1
CONSTRAINTS="$DIR/constraints.txt"
echo "torch==2.13.0" > "$CONSTRAINTS"   # the CPU build
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q --no-deps "sglang==$VERSION"
# sglang 0.5.23's Requires-Dist less the CUDA-only packages, torchvision/torchaudio/torchcodec/timm
# (image, audio and video models only) and tools a server does not import (py-spy, build). triton: imported
# at load time (its decorators only; nothing is compiled on this path).
"$PY" -m pip install -q -c "$CONSTRAINTS" \
  aiohttp "anthropic>=0.20.0" blobfile==3.0.0 compressed-tensors==0.18.0 datasets distro easydict einops \
  fastapi gguf interegular "kernels>=0.14.1,<0.15" "llguidance>=1.7.6,<2.0.0" "mistral_common>=1.11.5" \
  modelscope msgspec ninja numba==0.65.1 numpy nvidia-ml-py openai==2.8.0 openai-harmony==0.0.4 orjson \
  outlines==0.1.11 packaging partial_json_parser pillow "prometheus-client>=0.20.0" psutil pybase64 pydantic \
  "python-dateutil<3" python-multipart "pyzmq>=25.1.2" regex requests scipy sentencepiece==0.2.1 setproctitle \
  "smg-grpc-servicer>=0.9.0" soundfile==0.13.1 tiktoken tokenizers==0.23.2 transformers==5.19.0 "uvicorn>=0.51" \
  uvloop watchfiles xgrammar==0.2.7 xxhash zstandard IPython apache-tvm-ffi==0.1.11 triton
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp -r "$HERE"/sglang_cpu/sgl_kernel "$SITE"/
"$PY" "$HERE"/sglang_cpu/guard_torchvision.py
check || { echo "sglang $VERSION CPU environment: 'import sglang.launch_server' fails in $DIR" >&2; exit 1; }
router
echo "$STAMP" > "$DIR/.glmlight-ready"
echo "sglang $VERSION CPU environment: built in $(( $(date +%s) - start ))s" >&2
echo "$PY"
