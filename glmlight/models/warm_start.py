"""A short supervised warm start on a task's reference answers, cached on disk.

RL only learns when the policy sometimes succeeds; a randomly initialised tiny
model never does. The warm start trains on (prompt, label) pairs for a few
steps so that it sometimes does, and caches the result keyed by everything that
determines it, so it runs once per machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from glmlight.config import WarmStartConfig
from glmlight.prompt import PromptSource
from glmlight.models.tokenizer import encode_chat

log = logging.getLogger(__name__)


def warm_start_key(model: torch.nn.Module, cfg: WarmStartConfig, task_identity: dict[str, Any]) -> str:
    config = model.config.to_dict()
    config.pop("transformers_version", None)
    blob = json.dumps({"model": config, "task": task_identity, "steps": cfg.steps, "lr": cfg.lr,
                       "batch_size": cfg.batch_size, "init": _param_fingerprint(model)}, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


@torch.no_grad()
def _param_fingerprint(model: torch.nn.Module) -> float:
    return float(sum(p.double().sum() for p in model.parameters()))


def supervised_warm_start(model: torch.nn.Module, tokenizer: Any, source: PromptSource, cfg: WarmStartConfig,
                          task_identity: dict[str, Any]) -> str | None:
    """Train `model` in place on `cfg.steps` batches (or load the cached result). Returns the cache path."""
    if cfg.steps <= 0:
        return None
    path = os.path.join(cfg.cache_dir, f"warm_start-{warm_start_key(model, cfg, task_identity)}.safetensors")
    if os.path.exists(path):
        model.load_state_dict(load_file(path))
        log.info("warm start loaded from %s", path)
        return path
    log.info("warm start: %d supervised steps (cached afterwards at %s)", cfg.steps, path)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    model.train()
    eos = tokenizer.eos_token_id
    for step in range(cfg.steps):
        rows = []
        for i in range(cfg.batch_size):
            p = source[(step * cfg.batch_size + i) % len(source)]
            prompt = encode_chat(tokenizer, p.messages)
            answer = tokenizer(str(p.label), add_special_tokens=False)["input_ids"] + [eos]
            rows.append((prompt, answer))
        loss = _sft_loss(model, rows, tokenizer.pad_token_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == cfg.steps - 1:
            log.info("warm start step %d/%d loss %.4f", step + 1, cfg.steps, loss.item())
    model.eval()
    os.makedirs(cfg.cache_dir, exist_ok=True)
    tmp = path + ".tmp"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp)
    os.replace(tmp, path)
    return path


def _sft_loss(model: torch.nn.Module, rows: list[tuple[list[int], list[int]]], pad_id: int) -> torch.Tensor:
    L = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), L), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for i, (p, a) in enumerate(rows):
        seq = p + a
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(a)
        mask[i, : len(seq)] = 1
    dev = next(model.parameters()).device
    logits = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             labels[:, 1:].reshape(-1).to(dev), ignore_index=-100)
