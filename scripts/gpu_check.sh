#!/usr/bin/env bash
# The real-server check on a CUDA machine, in about ten minutes:
#   1. installs vLLM and SGLang from the package registry, each in its own virtual environment
#      (in parallel; reused when already there), and a trainer environment with glmlight;
#   2. runs tests/integration/servers/test_real_servers.py against a real vLLM and a real SGLang server, each started by
#      glmlight's managed launch on 127.0.0.1 with a tiny Llama built locally (float32);
#   3. runs scripts/bench.py --device cuda --quick (engine, GRPO, FLOP/s and the vLLM client row).
#
#   scripts/gpu_check.sh [OUT_DIR]          # default OUT_DIR: ./gpu-check-<date>
#
# Environment: GLMLIGHT_GPU_CHECK_ENVS (where the environments go; default ~/.cache/glmlight/gpu-check),
# VLLM_VERSION (default 0.33.0), SGLANG_VERSION (default 0.5.23), CUDA_VISIBLE_DEVICES (one GPU is
# enough; both servers share it, a quarter of its memory each).
# Everything it prints also goes to OUT_DIR: install logs, pytest output, server logs, bench JSON.
#
# This script has not run yet: no GPU was available where it was written (docs/servers.md).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${1:-$REPO/gpu-check-$(date +%Y%m%d-%H%M%S)}
ENVS=${GLMLIGHT_GPU_CHECK_ENVS:-$HOME/.cache/glmlight/gpu-check}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT" "$ENVS"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start ))s] $*"; }

command -v nvidia-smi >/dev/null || { echo "error: no nvidia-smi: this check needs a CUDA machine" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
lscpu | grep 'Model name' || true

venv() {  # venv DIR SPEC...: build once, reuse afterwards
  local dir=$1; shift
  if [ -f "$dir/.glmlight-ready" ]; then stamp "reusing $dir"; return 0; fi
  rm -rf "$dir" && "$PYTHON" -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip
  "$dir/bin/python" -m pip install -q "$@"
  touch "$dir/.glmlight-ready"
}

stamp "installing vllm==$VLLM_VERSION, sglang==$SGLANG_VERSION and the trainer environment (in parallel)"
venv "$ENVS/vllm-$VLLM_VERSION" "vllm==$VLLM_VERSION" > "$OUT/install-vllm.log" 2>&1 &
pid_vllm=$!
venv "$ENVS/sglang-$SGLANG_VERSION" "sglang==$SGLANG_VERSION" > "$OUT/install-sglang.log" 2>&1 &
pid_sglang=$!
venv "$ENVS/trainer" torch -e "$REPO[dev]" > "$OUT/install-trainer.log" 2>&1 &
pid_trainer=$!
status=0
wait $pid_vllm || { echo "vllm install failed: $OUT/install-vllm.log" >&2; status=1; }
wait $pid_sglang || { echo "sglang install failed: $OUT/install-sglang.log" >&2; status=1; }
wait $pid_trainer || { echo "trainer install failed: $OUT/install-trainer.log" >&2; exit 1; }
stamp "installed"

TRAINER="$ENVS/trainer/bin/python"
"$TRAINER" -c "import torch; assert torch.cuda.is_available(), 'the trainer environment sees no GPU'; print(torch.__version__, torch.cuda.get_device_name(0))"
[ -f "$ENVS/vllm-$VLLM_VERSION/.glmlight-ready" ] && export GLMLIGHT_VLLM_PYTHON="$ENVS/vllm-$VLLM_VERSION/bin/python"
[ -f "$ENVS/sglang-$SGLANG_VERSION/.glmlight-ready" ] && export GLMLIGHT_SGLANG_PYTHON="$ENVS/sglang-$SGLANG_VERSION/bin/python"
export GLMLIGHT_REAL_DEVICE=cuda PYTHONPATH=$REPO WANDB_MODE=disabled
[ -n "${GLMLIGHT_VLLM_PYTHON:-}" ] && "$GLMLIGHT_VLLM_PYTHON" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
[ -n "${GLMLIGHT_SGLANG_PYTHON:-}" ] && "$GLMLIGHT_SGLANG_PYTHON" -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"

stamp "real-server tests (vLLM: ${GLMLIGHT_VLLM_PYTHON:-none}, SGLang: ${GLMLIGHT_SGLANG_PYTHON:-none})"
# --basetemp keeps the server logs (<tmp>/real-*/vllm-server-*.log) under OUT
timeout 420 "$TRAINER" -m pytest -q -rs tests/integration/servers/test_real_servers.py -p no:cacheprovider --durations=0 -s \
  --basetemp="$OUT/pytest" 2>&1 | tee "$OUT/pytest.log" || status=1

stamp "benchmarks on the GPU"
timeout 300 "$TRAINER" scripts/bench.py --device cuda --quick --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" || status=1

stamp "done (exit $status); everything is in $OUT"
exit $status
