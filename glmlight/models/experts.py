"""The routed experts of a mixture-of-experts layer, with every gather and scatter ordered.

Each token goes to its top-k experts: the (token, expert) pairs are sorted by expert, the tokens gathered with
`index_select`, one grouped matmul runs per projection, and the outputs are summed back into their tokens with
`index_add`. On CPU both of those sum duplicate indices one after another, in the backward too (`index_select`'s
backward is `index_add_`), so a step's gradients do not depend on how threads are scheduled.

transformers' own experts forward for these layers (`integrations/moe.py`, `grouped_mm_experts_forward`,
transformers 5.25.0) gathers with indexing (`hidden_states[perm // num_top_k]`). Indexing's CPU backward is
`index_put_` with accumulate, whose threads add the k copies of a token into its gradient in the order they
reach them: the last bits of a step's gradients then follow thread timing. glmlight registers this function
in transformers' experts interface as `SORTED` and `install_sorted_experts` selects it for the Hugging Face
MoE models it loads (the GLM-4.x models; the critic of a GLM-5 policy); glmlight's own GLM-5 trainer forward
calls `sorted_experts` directly.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SORTED = "glmlight_sorted"


def sorted_experts(experts: torch.nn.Module, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """`out` (zeros where None) plus Σ_j w[n, j] · expert_{idx[n, j]}(x[n]) for every token n of x [N, h].

    idx, w [N, k]: the experts chosen and their routing weights. `experts` holds the weights in transformers'
    layout: gate_up_proj [E, 2m, h] (gate rows first), down_proj [E, h, m], and `num_experts`. The routing weight
    scales the down projection's input (the projection is linear) rather than its output. The first four
    arguments are those of transformers' experts interface (`ExpertsInterface`: module, hidden states, top-k
    indices, top-k weights), so the function registers as it is."""
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    tok = order.div(idx.shape[1], rounding_mode="floor")
    offs = torch.bincount(flat, minlength=experts.num_experts).cumsum(0).to(torch.int32)
    g, u = F.grouped_mm(x.index_select(0, tok), experts.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    scale = w.reshape(-1).index_select(0, order)[:, None].to(x.dtype)
    y = F.grouped_mm(F.silu(g) * u * scale, experts.down_proj.transpose(1, 2), offs=offs)
    return (torch.zeros_like(x) if out is None else out).index_add(0, tok, y)


def _supported(experts: torch.nn.Module) -> bool:
    """The layout `sorted_experts` computes: concatenated gate and up rows gated as silu(gate) * up, no bias, not
    transposed, no norm after the experts, one process holding every expert."""
    from transformers.integrations.moe import _default_apply_gate

    act = getattr(experts, "act_fn", None)
    return (getattr(type(experts), "_apply_gate", None) is _default_apply_gate
            and getattr(experts, "has_gate", False) and getattr(experts, "is_concatenated", False)
            and not getattr(experts, "has_bias", True) and not getattr(experts, "is_transposed", True)
            and not getattr(experts, "has_post_expert_norm", True) and not getattr(experts, "_is_expert_parallel", True)
            and (isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation")
            and all(hasattr(experts, a) for a in ("gate_up_proj", "down_proj", "num_experts")))


def install_sorted_experts(model: torch.nn.Module) -> int:
    """Select `sorted_experts` for every experts layer of a Hugging Face `model` that dispatches through transformers'
    experts interface; returns how many layers it serves. A model with an experts layer of another layout keeps
    transformers' implementation, logged."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    layers = [m for m in model.modules()
              if hasattr(m, "_apply_gate") and hasattr(m, "is_transposed") and hasattr(m, "gate_up_proj")]
    if not layers or not hasattr(model, "set_experts_implementation"):
        return 0
    if not all(_supported(m) for m in layers):
        log.info("%s: an experts layer's layout is not the one glmlight's ordered experts forward computes; "
                 "transformers' %r stays (its CPU backward sums by thread timing: trainer.deterministic=true "
                 "orders it)", type(model).__name__, model.config._experts_implementation)
        return 0
    if SORTED not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(SORTED, sorted_experts)
    model.set_experts_implementation(SORTED)
    return len(layers)
