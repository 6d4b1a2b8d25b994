"""Import shim for `sgl_kernel`, installed only into the SGLang CPU test environment that
scripts/sglang_cpu_venv.sh builds. It computes nothing.

Why it exists: with SGLANG_USE_CPU_ENGINE=1, modules that `sglang.launch_server` loads import CPU
kernels from `sgl_kernel` at load time, with no fallback (`NAMES` below: each name and the sglang
0.5.23 module that imports it; the speculative-decoding ones load with the scheduler even when no
speculative decoding is configured). The package registry has no CPU build of sgl-kernel / sglang-kernel (its wheels are CUDA binaries and
there is no source distribution). On a CPU without AMX, started with `--attention-backend
torch_native`, every compute path SGLang takes is torch-native: these functions are never called
while generating, scoring, pausing, aborting or updating weights. Should any code path ever call one
of them, it raises instead of computing something. Only these names exist here: an import of any
other name fails as it would without the package, so SGLang's own fallbacks still apply.
"""


class SglKernelShimCalled(RuntimeError):
    pass


def _refuse(name):
    def call(*args, **kwargs):
        raise SglKernelShimCalled(
            f"sgl_kernel.{name} was called, but this environment has only an import shim for sgl_kernel "
            "(no CPU build exists on the package registry); this SGLang code path cannot run here")

    call.__name__ = name
    return call


NAMES = {
    "copy_all_layer_kv_cache_cpu": "sglang/kernels/ops/kvcache/cache_move.py",
    "assign_req_to_token_pool_cpu": "sglang/srt/mem_cache/allocation.py",
    "build_tree_kernel_efficient_cpu": "sglang/kernels/ops/speculative/spec_tree.py",
    "verify_tree_greedy_cpu": "sglang/kernels/ops/speculative/spec_tree.py",
    "fill_accept_out_cache_loc_cpu": "sglang/kernels/ops/speculative/eagle.py",
    "fill_bonus_tokens_cpu": "sglang/kernels/ops/speculative/eagle.py",
    "assign_draft_cache_locs_contiguous_cpu": "sglang/kernels/ops/speculative/cache_locs.py",
    "assign_extend_cache_locs_cpu": "sglang/kernels/ops/speculative/cache_locs.py",
    "rotate_input_ids_cpu": "sglang/kernels/ops/speculative/multi_layer_eagle.py",
}
globals().update({name: _refuse(name) for name in NAMES})
