"""The model contract: how policy, reference, critic and teacher checkpoints are built and loaded.

`model.path` names a local Hugging Face checkpoint (weights as safetensors);
without it the tiny GLM-5 default is built, randomly initialised from `seed`,
with the local character tokenizer. Nothing is downloaded. A checkpoint loads in its own dtype (config.json's
`dtype` / `torch_dtype`, float32 where it names none) unless `model.dtype` names another; the tiny GLM-5 in float32.

A checkpoint directory that cannot serve (no tokenizer, no or an unreadable config.json,
no safetensors weights, weights whose shapes or names disagree with config.json) stops the
run with one line naming the directory and what is wrong; a model is never trained from
randomly initialised tensors that the checkpoint was supposed to provide.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from glmlight.dtypes import resolve_dtype
from glmlight.errors import ConfigError
from glmlight.models.experts import install_sorted_experts
from glmlight.models.glm5.indexer import install_fast_indexer
from glmlight.models.chat_templates import with_chat_template
from glmlight.models.tiny import PRESETS, tiny_config
from glmlight.models.tokenizer import CHAT_TEMPLATE, build_char_tokenizer

log = logging.getLogger(__name__)

# Files of which at least one makes a directory hold a tokenizer transformers can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tiktoken.model")


def load_tokenizer(path: str | None, trust_remote_code: bool = False, key: str = "model.path",
                   chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of a local checkpoint (`key` names the config key in errors), or the character tokenizer;
    with `chat_template` (glmlight/models/chat_templates.py) rendering with that template instead of its own."""
    if path is None:
        tok = build_char_tokenizer()
        return with_chat_template(tok, chat_template, char_tokenizer=True) if chat_template else tok
    tok = _checkpoint_tokenizer(path, trust_remote_code, key)
    return with_chat_template(tok, chat_template, char_tokenizer=False) if chat_template else tok


def _checkpoint_tokenizer(path: str, trust_remote_code: bool, key: str) -> PreTrainedTokenizerBase:
    _check_local(path, key)
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES) and not trust_remote_code:
        raise ConfigError(f"config error: {key}={path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                          "copy the checkpoint's tokenizer files into it")
    try:
        with _quiet_transformers():
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds, often naming neither file nor directory
        raise ConfigError(f"config error: {key}={path!r}: the tokenizer cannot be loaded ({_first_line(e)}); "
                          f"files there: {_listing(path)}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        log.warning("the tokenizer in %s has no chat template; prompts are rendered with glmlight's GLM-style one "
                    "(<|role|>content ... <|assistant|>), whose role markers may not be tokens of this tokenizer", path)
        tok.chat_template = CHAT_TEMPLATE
    return tok


def load_causal_lm(path: str | None, tokenizer: PreTrainedTokenizerBase, *, preset: str = "tiny",
                   dtype: str | None = None, seed: int = 0, trust_remote_code: bool = False, key: str = "model.path",
                   arch: str = "glm5", **tiny_overrides) -> PreTrainedModel:
    """A local checkpoint (safetensors only), or the tiny `arch` model (glmlight/models/tiny.py) initialised from
    `seed`, in `dtype`; None: the checkpoint's own (`checkpoint_dtype`), float32 for the tiny models."""
    torch_dtype = resolve_dtype(dtype) if dtype is not None else torch.float32
    if path is None:
        if preset not in PRESETS:
            where = key.rsplit(".", 1)[0] + ".preset"
            raise ConfigError(f"config error: {where}={preset!r} is not one of {sorted(PRESETS)}")
        config = tiny_config(arch, len(tokenizer), preset, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id,
                             **{k: v for k, v in tiny_overrides.items() if v is not None})
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)
        install_fast_indexer(model)
        install_sorted_experts(model)
        return model.to(torch_dtype)
    config = check_checkpoint(path, key)
    if dtype is None:
        torch_dtype = checkpoint_dtype(path, config, key)
    try:
        with _quiet_transformers():
            model, info = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch_dtype, use_safetensors=True, trust_remote_code=trust_remote_code,
                local_files_only=True, output_loading_info=True, ignore_mismatched_sizes=True)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"config error: {key}={path!r}: the model cannot be built from config.json and its weights "
                          f"({_first_line(e)})") from None
    _check_loading_info(path, key, config, info)
    install_fast_indexer(model)
    install_sorted_experts(model)
    return model


def checkpoint_dtype(path: str, config: dict, key: str = "model.path") -> torch.dtype:
    """The dtype a checkpoint names in config.json (`dtype`, or `torch_dtype` as transformers before 4.56 wrote it;
    a multimodal config's `text_config` too), float32 where it names none; logged, with how to choose another."""
    where = "dtype" if config.get("dtype") else "torch_dtype"
    name = config.get("dtype") or config.get("torch_dtype")
    if name is None and isinstance(config.get("text_config"), dict):
        text = config["text_config"]
        where, name = "text_config.dtype", text.get("dtype") or text.get("torch_dtype")
    setting = key.rsplit(".", 1)[0] + ".dtype"
    if name is None:
        log.info("%s names no dtype in config.json: loaded in float32 (%s=... chooses)", path, setting)
        return torch.float32
    try:
        dtype = resolve_dtype(str(name).removeprefix("torch."))
    except ValueError:
        raise ConfigError(f"config error: {key}={path!r}: config.json's {where} {name!r} is not a dtype glmlight "
                          f"trains in; set {setting}=float32 or bfloat16") from None
    log.info("%s: loaded in its own dtype, %s (config.json's %s; %s=... chooses another)", path,
             str(dtype).removeprefix("torch."), where, setting)
    return dtype


def check_checkpoint(path: str, key: str = "model.path") -> dict:
    """config.json (a JSON object with a model_type) and safetensors weights are there; returns the config."""
    _check_local(path, key)
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ConfigError(f"config error: {key}={path!r} has no config.json (files there: {_listing(path)})")
    try:
        with open(cfg_file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"config error: {key}={path!r}: config.json is not readable JSON ({_first_line(e)})") from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ConfigError(f"config error: {key}={path!r}: config.json has no model_type (it names the architecture, "
                          "e.g. \"glm_moe_dsa\"); is it the checkpoint's own config.json?")
    if not glob.glob(os.path.join(path, "*.safetensors")):
        bins = glob.glob(os.path.join(path, "*.bin"))
        extra = " (only .bin weights, which are never loaded: convert them to safetensors)" if bins else ""
        raise ConfigError(f"config error: {key}={path!r} has no safetensors weights{extra}")
    return config


def _check_loading_info(path: str, key: str, config: dict, info: dict) -> None:
    """Weights and config.json must describe the same model: nothing missing or of another shape."""
    mismatched, missing = list(info.get("mismatched_keys") or []), sorted(info.get("missing_keys") or [])
    unexpected = sorted(info.get("unexpected_keys") or [])
    where = f"config error: {key}={path!r}: config.json and the weights disagree"
    if mismatched:
        name, ckpt, model = mismatched[0]
        raise ConfigError(f"{where}: {name} is {list(ckpt)} in the weights but {list(model)} by config.json "
                          f"({len(mismatched)} of another shape)")
    if missing:
        raise ConfigError(f"{where}: the weights lack tensors the model needs ({len(missing)}), e.g. {missing[0]}")
    layers = config.get("num_hidden_layers")
    # the MTP layers after the decoder layers (num_nextn_predict_layers) are read by glmlight.models.mtp
    nextn = config.get("num_nextn_predict_layers") or 0
    mtp = [k for k in unexpected if isinstance(layers, int) and (m := re.match(r"model\.layers\.(\d+)\.", k))
           and layers <= int(m.group(1)) < layers + nextn]
    unexpected = [k for k in unexpected if k not in set(mtp)]
    beyond = [k for k in unexpected if isinstance(layers, int) and (m := re.search(r"\blayers\.(\d+)\.", k))
              and int(m.group(1)) >= layers]
    if beyond:
        raise ConfigError(f"{where}: the weights hold layers beyond num_hidden_layers={layers}"
                          f"{f' + num_nextn_predict_layers={nextn}' if nextn else ''}, e.g. {beyond[0]}")
    if unexpected:
        log.warning("%s: %d tensors in the weights have no place in the model and are ignored, e.g. %s",
                    path, len(unexpected), unexpected[0])


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' load report and warnings off: the checks here say what matters in one line."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1].strip() if text else ''}".rstrip(": ")


def _listing(path: str, limit: int = 8) -> str:
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return "?"
    return (", ".join(names[:limit]) + (", ..." if len(names) > limit else "")) or "none"


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str) -> str:
    """Save as a Hugging Face checkpoint (safetensors; a LoRA policy merged), written to a temp dir
    then renamed (`glmlight.models.export.export_hf`)."""
    from glmlight.models.export import export_hf

    return export_hf(model, tokenizer, path)


def _check_local(path: str, key: str = "model.path") -> None:
    if not os.path.isdir(path):
        raise ConfigError(f"config error: {key}={path!r} is not a local directory "
                          "(checkpoints are never downloaded; point model.path at a local Hugging Face checkpoint)")
