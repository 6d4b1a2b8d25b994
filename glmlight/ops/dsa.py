"""DSA (DeepSeek-V3.2 sparse attention, GLM-5) top-k selection with a fixed tie rule.

The lightning indexer scores each earlier key j of a query i as
index[i, j] = Σ_h w_h(x_i) · relu(q_h(i) · k(j)) (DeepSeek-V3.2 §2.1), and the query attends to
the k keys of largest score. The scores are sums of ReLUs, so they tie exactly (at 0) often;
`Tensor.topk` leaves the choice among ties at the cut-off open (and padding changes it). Every
glmlight path — the engine's runner, the training forward and the indexer installed on loaded
models — picks the most recent tied keys, so a selection depends only on the row's own scores.
"""

from __future__ import annotations

import torch


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the k largest entries along the last dim, ties at the cut-off to the most
    recent positions. Trailing -inf entries (padding) are selected only when fewer than k entries
    are finite; callers mask them."""
    kth = scores.topk(k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above, tied = scores > kth, scores == kth
    need = k - above.sum(-1, keepdim=True)
    upto = tied.cumsum(-1)  # ties at or before each position; those after it: upto[-1] - upto
    return above | (tied & (upto > upto[..., -1:] - need))


def topk_recent(scores: torch.Tensor, k: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The same choice as `topk_mask`, as indices (unordered): one top-k over int64 keys that order
    first by score (the float32's bits made order-preserving) and then by position. `positions`:
    arange(T), if the caller has it."""
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0: equal scores, equal keys
    order = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long() * 2**32
    if positions is None:
        positions = torch.arange(scores.shape[-1], device=scores.device)
    return (order + positions).topk(k, dim=-1, sorted=False).indices
