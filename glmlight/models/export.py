"""The trained policy as a Hugging Face checkpoint that transformers, SGLang and vLLM load.

`export_hf(policy, tokenizer, out)` writes `out/`: the policy (LoRA merged into the base weights) with
`save_pretrained` (safetensors only: config.json, generation_config.json, model*.safetensors) and the
tokenizer, atomically — everything is written into a temporary directory beside `out`, which then
replaces `out` by renames, so `out` is either the old export or the new one, never a mixture. Every file
and folder gets the mode any file the user writes gets (0666 / 0777 less the umask): transformers writes
model.safetensors through a private temporary file (mode 0600), which would keep it from other users and
from a server running under another account.

A policy with MTP layers (`glmlight.models.mtp`) exports them as its checkpoint had them: `model.layers.{L + k}.*`
(L = num_hidden_layers) with each layer's copies of the shared embedding and head, and config.json's
`num_nextn_predict_layers`: the names SGLang's and vLLM's MTP loaders read.

`fp8=True` writes the block-FP8 checkpoint layout instead (`glmlight.models.fp8_checkpoint`: float8_e4m3fn
weights with `weight_scale_inv`, one per expert, and a `quantization_config` in config.json): what an
SGLang or vLLM server is started with for `rollout.weight_format=fp8`.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from glmlight.models.lora import merged_named_tensors, plain_model
from glmlight.models.mtp import checkpoint_tensors, is_mtp_checkpoint_name, mtp_of


def export_hf(policy: torch.nn.Module, tokenizer: Any, out: str, *, fp8: bool = False,
              block: tuple[int, int] = (128, 128), state_dict: dict[str, torch.Tensor] | None = None) -> str:
    """Write the policy and tokenizer to `out` (see the module docstring); returns its absolute path.
    `state_dict`: the policy's whole weights when they are sharded (gathered by the caller)."""
    out = os.path.abspath(out.rstrip("/"))
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model = plain_model(policy)
        mtp = mtp_of(model)
        if mtp is None:
            model.save_pretrained(tmp, state_dict=state_dict)
        else:  # the MTP layers under the names the checkpoint and the servers give them (glmlight.models.mtp),
            # through save_pretrained's own conversion (fused experts written one per expert, as for every layer);
            # the copies of the shared embedding and head are written as tensors of their own
            state = state_dict if state_dict is not None else model.state_dict()
            named = checkpoint_tensors(state.items(), mtp.first_layer)
            model.save_pretrained(tmp, state_dict={k: v.detach().clone() if is_mtp_checkpoint_name(k, mtp.first_layer)
                                                   else v for k, v in named})
        if fp8:
            _rewrite_fp8(policy, model, tmp, block)
        tokenizer.save_pretrained(tmp)
        _no_pickles(tmp)
        user_modes(tmp)
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def current_umask() -> int:
    """The process's umask (read from /proc where it is shown, so that it is never changed, even briefly)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def user_modes(root: str) -> None:
    """Give `root` and everything under it the modes a file or folder the user creates gets: 0666 (files)
    and 0777 (folders) less the umask."""
    mask = current_umask()
    os.chmod(root, 0o777 & ~mask)
    for folder, dirs, files in os.walk(root):
        for d in dirs:
            os.chmod(os.path.join(folder, d), 0o777 & ~mask)
        for f in files:
            path = os.path.join(folder, f)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def replace_dir(src: str, dst: str) -> None:
    """Put directory `src` at `dst` by renames (an existing `dst` is moved aside first, then removed)."""
    old = None
    if os.path.exists(dst):
        old = f"{dst}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _rewrite_fp8(policy: torch.nn.Module, model: torch.nn.Module, root: str, block: tuple[int, int]) -> None:
    from safetensors.torch import save_file

    from glmlight.models.fp8_checkpoint import fp8_checkpoint_tensors, fp8_quantization_config

    for f in os.listdir(root):
        if f.startswith("model") and (f.endswith(".safetensors") or f.endswith(".index.json")):
            os.remove(os.path.join(root, f))
    config_path = os.path.join(root, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    named = merged_named_tensors(policy)
    mtp = mtp_of(model)
    if mtp is not None:
        named = checkpoint_tensors(named, mtp.first_layer)
    tensors = fp8_checkpoint_tensors(named, block=block, model_type=config.get("model_type"))
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    first = mtp.first_layer if mtp is not None else None  # an MTP layer's copies of the shared tensors: own storage
    save_file({k: v.clone() if first is not None and is_mtp_checkpoint_name(k, first) else v.contiguous()
               for k, v in tensors if k not in tied}, os.path.join(root, "model.safetensors"),
              metadata={"format": "pt"})
    config["quantization_config"] = fp8_quantization_config(block)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def _no_pickles(root: str) -> None:
    """Safetensors only: no pickled weights in the export."""
    bad = [f for f in os.listdir(root) if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
    if bad:
        raise RuntimeError(f"export wrote non-safetensors weight files: {bad}")
