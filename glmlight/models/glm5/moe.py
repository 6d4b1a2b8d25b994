"""The MoE block of GlmMoeDsa (GLM-5), Glm4MoeLite (GLM-4.7-Flash) and Glm4Moe (GLM-4.5 / 4.6 / 4.7) for the
embedded engine's GLM-5 and dense runners (transformers builds the three alike).

Same function as `GlmMoeDsaMoE.forward` / `Glm4MoeMoE.forward` (sigmoid router with a selection-only
bias, group-limited top-k experts, normalised and scaled weights, plus the shared expert),
computed one of two ways:

- dense, for few tokens (decode steps): every expert on every token, weighted by
  the mostly-zero routing weights, with the shared expert stacked as one more
  expert of weight 1 — three batched matmuls and no per-expert Python loop;
- grouped, for more tokens: tokens sorted by expert and one grouped matmul per
  projection (`torch._grouped_mm`), so only the routed FLOPs are spent.

On accelerators the grouped case uses the model's own MoE kernels, and so does
every case for models whose experts are too large for the dense form ever to pay
(then no stacked copy of the expert weights is kept).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

# The dense form while the FLOPs it wastes on unselected experts stay below this.
DENSE_MOE_MAX_WASTED_FLOPS = 6e6


def dense_possible(cfg) -> bool:
    """Whether even one token is few enough for the dense form (small experts only)."""
    return (cfg.n_routed_experts - cfg.num_experts_per_tok) * cfg.hidden_size * cfg.moe_intermediate_size * 6 \
        <= DENSE_MOE_MAX_WASTED_FLOPS


class Stacked(NamedTuple):
    """Expert weights stacked for x @ W: gate_up [E', h, 2m], down [E', m, h] (E' = E, or E + 1 when
    the shared expert has the routed experts' width and is appended last: `shared`), and gate_up as
    one [h, E' * 2m] matrix for the dense form."""

    gate_up: torch.Tensor
    down: torch.Tensor
    shared: bool
    gate_up_flat: torch.Tensor


@torch.no_grad()
def stacked_experts(mlp: torch.nn.Module) -> Stacked | None:
    """The experts of `mlp` as `Stacked`; None (no copy of the experts kept) when the dense form can
    never be used."""
    if not dense_possible(mlp.config):
        return None
    ex, sh = mlp.experts, mlp.shared_experts
    gate_up, down, shared = ex.gate_up_proj, ex.down_proj, False
    if sh.gate_proj.weight.shape[0] == ex.intermediate_dim:
        gate_up = torch.cat([gate_up, torch.cat([sh.gate_proj.weight, sh.up_proj.weight])[None]])
        down = torch.cat([down, sh.down_proj.weight[None]])
        shared = True
    gate_up = gate_up.transpose(1, 2).contiguous()
    return Stacked(gate_up, down.transpose(1, 2).contiguous(), shared,
                   gate_up.transpose(0, 1).reshape(gate_up.shape[1], -1).contiguous())


def moe_forward(mlp: torch.nn.Module, stacked: Stacked | None, x: torch.Tensor) -> torch.Tensor:
    """GlmMoeDsaMoE(x) for x [B, S, h], with `stacked_experts(mlp)` weights. Inside a compiled
    graph the dense form is used whenever it exists (the others have data-dependent shapes)."""
    return moe_forward_routed(mlp, stacked, x, want_ids=False)[0]


def moe_forward_routed(mlp: torch.nn.Module, stacked: Stacked | None, x: torch.Tensor,
                       want_ids: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`moe_forward`, and the expert ids each token was routed to [B * S, k] (long; None unless
    `want_ids`, where only the model's own MoE knows them)."""
    B, S, h = x.shape
    cfg = mlp.config
    E, k, m = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    if stacked is None or not (torch.compiler.is_compiling()
                               or B * S * (E - k) * h * m * 6 <= DENSE_MOE_MAX_WASTED_FLOPS):
        return _sparse_moe(mlp, stacked, x, want_ids)
    xt = x.view(B * S, h)
    w, idx = route(mlp.gate, xt)
    return _with_shared(mlp, stacked, xt, _dense(stacked, xt, w, idx)).view(B, S, h), idx


@torch.compiler.disable  # data-dependent group sizes: eager, also when called from a compiled step
def _sparse_moe(mlp: torch.nn.Module, stacked: Stacked | None, x: torch.Tensor,
                want_ids: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Only the routed FLOPs: the grouped form on CPU, else the model's own MoE (whose routing is
    the same function, `route`: asked for, the ids are computed once more beside it)."""
    xt = x.reshape(-1, x.shape[-1])
    if stacked is None or x.device.type != "cpu":
        return mlp(x), route(mlp.gate, xt)[1] if want_ids else None
    w, idx = route(mlp.gate, xt)
    return _with_shared(mlp, stacked, xt, _grouped(stacked, xt, w, idx)).view(x.shape), idx


def _with_shared(mlp: torch.nn.Module, st: Stacked, xt: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Adds the shared expert's output unless it is stacked with the routed ones."""
    return y if st.shared else y + mlp.shared_experts(xt)


def route(gate: torch.nn.Module, x: torch.Tensor, forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GlmMoeDsaTopkRouter (and Glm4Moe's, Glm4MoeLite's: the same function): sigmoid scores, bias for the choice
    only, top-k within the best `topk_group` groups (the router itself decides when there are groups), normalise,
    scale.

    `forced` [N, k] (routing replay): the experts to use, row by row (a row of -1: the router's own
    choice). The weights of the experts used are the router's function of its scores either way, so
    gradients reach the router as without replay."""
    if forced is None and gate.num_group > 1:
        _, w, idx = gate(x)
        return w, idx
    scores = F.linear(x.float(), gate.weight.float()).sigmoid()
    if forced is None or bool((forced < 0).any()):
        own = gate(x)[2] if gate.num_group > 1 else \
            torch.topk(scores + gate.e_score_correction_bias, k=gate.top_k, dim=-1, sorted=False)[1]
        idx = own if forced is None else torch.where(forced >= 0, forced.long(), own)
    else:
        idx = forced.long()
    return router_weights(gate, scores, idx), idx


def router_weights(gate: torch.nn.Module, scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The GlmMoeDsa / Glm4Moe / DeepSeek-V3 router's weights of the experts `idx` from its sigmoid `scores`
    (unbiased: the correction bias only chooses)."""
    w = scores.gather(1, idx)
    if gate.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * gate.routed_scaling_factor


def _dense(st: Stacked, xt: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, two plain matmuls: [N, h] @ [h, E' * 2m], then the activations,
    scaled by the (mostly zero) routing weights, [N, E' * m] @ [E' * m, h] sums over the experts."""
    N, E1 = xt.shape[0], st.gate_up.shape[0]
    weights = torch.zeros(N, E1, dtype=w.dtype, device=xt.device)
    if st.shared:
        weights[:, -1] = 1.0
    weights.scatter_(1, idx, w)
    g, u = torch.matmul(xt, st.gate_up_flat).view(N, E1, -1).chunk(2, dim=-1)  # [N, E', m] each
    act = F.silu(g) * u * weights.to(xt.dtype)[..., None]
    return torch.matmul(act.view(N, -1), st.down.view(-1, st.down.shape[-1]))


def _grouped(st: Stacked, xt: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    gate_up, down, shared = st.gate_up, st.down, st.shared
    N, k = idx.shape
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    tok = order.div(k, rounding_mode="floor")
    counts = torch.bincount(flat, minlength=gate_up.shape[0] - shared)
    ws = w.reshape(-1)[order]
    if shared:  # the shared expert is the last group, over every token
        tok = torch.cat([tok, torch.arange(N, device=xt.device)])
        counts = torch.cat([counts, counts.new_full((1,), N)])
        ws = torch.cat([ws, ws.new_ones(N)])
    offs = counts.cumsum(0).to(torch.int32)
    g, u = torch._grouped_mm(xt[tok], gate_up, offs=offs).chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(g) * u, down, offs=offs) * ws.to(xt.dtype)[:, None]
    return torch.zeros_like(xt).index_add_(0, tok, out)
