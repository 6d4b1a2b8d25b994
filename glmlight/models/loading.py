"""The model contract: how policy, reference, critic and teacher checkpoints are built and loaded.

`model.path` names a local Hugging Face checkpoint (weights as safetensors);
without it the tiny GLM-5 default is built, randomly initialised from `seed`,
with the local character tokenizer. Nothing is downloaded.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GlmMoeDsaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from glmlight.dtypes import resolve_dtype
from glmlight.errors import ConfigError
from glmlight.models.glm5.indexer import install_fast_indexer
from glmlight.models.tiny import tiny_glm5_config
from glmlight.models.tokenizer import CHAT_TEMPLATE, build_char_tokenizer


def load_tokenizer(path: str | None, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    if path is None:
        return build_char_tokenizer()
    _check_local(path)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def load_causal_lm(path: str | None, tokenizer: PreTrainedTokenizerBase, *, preset: str = "tiny",
                   dtype: str = "float32", seed: int = 0, trust_remote_code: bool = False,
                   **tiny_overrides) -> PreTrainedModel:
    """A local checkpoint (safetensors only), or the tiny GLM-5 initialised from `seed`."""
    torch_dtype = resolve_dtype(dtype)
    if path is None:
        config = tiny_glm5_config(len(tokenizer), preset, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id,
                                  **{k: v for k, v in tiny_overrides.items() if v is not None})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = GlmMoeDsaForCausalLM(config)
        install_fast_indexer(model)
        return model.to(torch_dtype)
    _check_local(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, use_safetensors=True,
                                                 trust_remote_code=trust_remote_code, local_files_only=True)
    install_fast_indexer(model)
    return model


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str) -> str:
    """Save as a Hugging Face checkpoint (safetensors; a LoRA policy merged), written to a temp dir
    then renamed (`glmlight.models.export.export_hf`)."""
    from glmlight.models.export import export_hf

    return export_hf(model, tokenizer, path)


def _check_local(path: str) -> None:
    if not os.path.isdir(path):
        raise ConfigError(f"config error: model.path={path!r} is not a local directory "
                          "(checkpoints are never downloaded; point model.path at a local Hugging Face checkpoint)")
