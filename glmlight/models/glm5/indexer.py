"""The DSA indexer's forward for every GlmMoeDsa model glmlight loads.

Two changes to transformers' `GlmMoeDsaIndexer.forward`, both within its function:
- speed: transformers computes the query-key scores with a matmul that broadcasts
  (copies) the keys over every query position; this computes the same scores as one
  bmm over (positions x heads);
- the top-k choice among scores tied exactly at the cut-off (they are sums of ReLUs
  and tie at 0 often) follows the engine's rule, the most recent keys
  (`glmlight.ops.dsa`), where `Tensor.topk` leaves it unspecified and
  padding-dependent. So the model's own forward (a reference model, a teacher, the
  engine's `score`, `model.forward=transformers`) selects the keys the engine and
  glmlight's training forward select. The indexer has no gradient either way.
"""

from __future__ import annotations

import types

import torch

from glmlight.ops.dsa import topk_recent


@torch.no_grad()
def index_scores(self, hidden_states, q_resid, position_embeddings, attention_mask, cache=None) -> torch.Tensor:
    """The DSA indexer's scores [B, S, T] (Σ_h w_h · relu(q_h·k) / sqrt(D)), -inf where masked; `self`
    is a GlmMoeDsaIndexer."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    B, S, _ = hidden_states.shape
    H, D, r = self.n_heads, self.head_dim, self.qk_rope_head_dim
    q = self.wq_b(q_resid).view(B, S, H, D)
    k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q[..., :r], k[..., :r], *position_embeddings, unsqueeze_dim=2)
    q, k = torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1).squeeze(2)
    if cache is not None:
        k = cache.update_indexer(k, self.layer_idx)
    T = k.shape[1]
    scores = torch.bmm(q.float().reshape(B, S * H, D), k.float().transpose(1, 2)).view(B, S, H, T)
    scores = torch.relu(scores * self.softmax_scale)
    weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * H**-0.5
    index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    return index.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool \
        else index + attention_mask


@torch.no_grad()
def _indexer_forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None,
                     cache=None):
    index = index_scores(self, hidden_states, q_resid, position_embeddings, attention_mask, cache)
    return topk_recent(index, min(self.index_topk, index.shape[-1])).to(torch.int32)


def install_fast_indexer(model: torch.nn.Module) -> int:
    """Replace the forward of every GlmMoeDsaIndexer in `model` (instance-level); returns how many."""
    n = 0
    for mod in model.modules():
        if type(mod).__name__ == "GlmMoeDsaIndexer":
            mod.forward = types.MethodType(_indexer_forward, mod)
            n += 1
    return n
