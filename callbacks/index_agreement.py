"""IndexAgreement (the sparse contract): do the engine's and the trainer's DSA indexers
pick the same top-k tokens for the same token sequences?

For GlmMoeDsa models, every `every_n_steps` RL steps both model copies run a
prefill over a few of the step's sequences with forward hooks on each layer's
indexer; the per-layer overlap |A ∩ B| / k of the selections is logged
(1.0 = identical). Needs an engine that exposes its model in this process (the
embedded engine); for server engines the check is skipped and says so once.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

import lightning.pytorch as pl
import torch

from glmlight.ops.mismatch import topk_agreement
from glmlight.sample import Experience

log = logging.getLogger(__name__)


@contextmanager
def capture_indexer_topk(model: torch.nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Records each layer's indexer output (top-k indices [B, S, k]) during a forward pass."""
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for name, mod in model.named_modules():
        if type(mod).__name__.endswith("Indexer") and hasattr(mod, "layer_idx"):
            def hook(m, args, out, idx=mod.layer_idx):
                captured[idx] = out.detach()
            handles.append(mod.register_forward_hook(hook))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def indexer_agreement(model_a: torch.nn.Module, model_b: torch.nn.Module, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor) -> dict[int, float]:
    """Per-layer top-k agreement of two models' DSA indexers on the same sequences (right-padded)."""
    sel = []
    for model in (model_a, model_b):
        dev = next(model.parameters()).device
        with capture_indexer_topk(model) as captured:
            model(input_ids=input_ids.to(dev), attention_mask=attention_mask.to(dev))
        sel.append({k: v.cpu() for k, v in captured.items()})
    out = {}
    valid = attention_mask.bool().cpu()
    for layer in sorted(set(sel[0]) & set(sel[1])):
        a, b = sel[0][layer][valid], sel[1][layer][valid]  # [N, k] over real query tokens
        out[layer] = float(topk_agreement(a, b))
    return out


class IndexAgreement(pl.Callback):
    """Logs, every `every_n_steps`, the per-layer DSA top-k agreement of the engine's and the
    trainer's model copies on a few of the step's sequences (`index_agreement/layer_<i>`, `.../mean`).

    Args:
        every_n_steps: the period in RL steps (0: off).
        num_sequences: how many of the step's sequences are compared.
    """

    reads_old_logprobs = False  # runs its own forwards

    def __init__(self, every_n_steps: int = 10, num_sequences: int = 4):
        self.every_n_steps, self.num_sequences = every_n_steps, num_sequences
        self._warned = False

    def on_experience(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Experience) -> None:
        if self.every_n_steps <= 0 or module.rl_step % self.every_n_steps:
            return
        engine_model = getattr(trainer.datamodule.engine, "model", None)
        if not isinstance(engine_model, torch.nn.Module):
            if not self._warned:
                log.warning("IndexAgreement: the engine's model is not in this process; check skipped")
                self._warned = True
            return
        seqs = [s.prompt_ids + s.response_ids for s in batch.samples[: self.num_sequences]]
        L = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), L), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        was_training = module.policy.training
        module.policy.eval()
        per_layer = indexer_agreement(engine_model, module.policy, ids, mask)
        module.policy.train(was_training)
        for layer, v in per_layer.items():
            batch.stats[f"index_agreement/layer_{layer}"] = v
        if per_layer:
            batch.stats["index_agreement/mean"] = sum(per_layer.values()) / len(per_layer)
