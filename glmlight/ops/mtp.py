"""Multi-token prediction (MTP): the input of one MTP depth, where each depth's targets lie, and its loss terms.

DeepSeek-V3 (arXiv 2412.19437, sec. 2.2, eq. 21-25), which GLM-4.5 and later follow: depth d (1..D) at position
t combines the previous depth's hidden state h^{d-1}_t (d = 1: the main model's) with the embedding of token
t + d, h'_t = M_d [RMSNorm(Emb(x_{t+d})); RMSNorm(h^{d-1}_t)], runs one decoder block over the positions and
predicts token t + d + 1 through the shared output head. The embedding half comes first, as SGLang's and
vLLM's MTP layers concatenate it (`enorm` then `hnorm`), so that a checkpoint's `eh_proj` reads the same here.

Tensors: response-side quantities are [B, T] over the response, right-padded, of a batch whose prompts are
left-padded to `prompt_length` P (glmlight.sample.Experience); the sequence is [B, P + T].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * (x / sqrt(mean(x^2) + eps)), normalised in float32 and scaled in x's dtype (the RMSNorm of GLM and
    DeepSeek models)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def mtp_input(embedding: torch.Tensor, hidden: torch.Tensor, enorm_weight: torch.Tensor,
              hnorm_weight: torch.Tensor, eh_proj_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The input of an MTP depth's decoder block [..., H]: eh_proj [enorm(embedding); hnorm(hidden)], from the
    embedding of the next token and the previous depth's hidden state (both [..., H]; eh_proj [H, 2H])."""
    x = torch.cat([rms_norm(embedding, enorm_weight, eps), rms_norm(hidden, hnorm_weight, eps)], dim=-1)
    return F.linear(x, eh_proj_weight)


def mtp_mask(loss_mask: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int, depth: int) -> torch.Tensor:
    """[B, T]: the response tokens depth `depth` (1-based) is trained to predict. Response token j (sequence
    position P + j) is depth d's prediction at position t = P + j - d - 1; it counts where the policy's loss
    counts it (`loss_mask`) and position t holds a real token (`attention_mask` [B, P + T]: not padding, t >= 0)."""
    B, T = loss_mask.shape
    t = torch.arange(T, device=loss_mask.device) + prompt_length - depth - 1
    real = attention_mask.gather(1, t.clamp(min=0).expand(B, T)).bool() & (t >= 0)
    return loss_mask * real.to(loss_mask.dtype)


def mtp_loss_terms(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of cross-entropy, number of correct argmax predictions, number of tokens) over `mask` of one depth's
    logits [B, T, V] for `labels` [B, T]; cross-entropy at temperature 1 in float32, with gradient."""
    keep = mask.bool()
    z = logits[keep].float()
    y = labels[keep]
    ce = F.cross_entropy(z, y, reduction="sum") if y.numel() else z.sum()
    correct = (z.detach().argmax(-1) == y).sum().float()
    return ce, correct, keep.sum().float()
