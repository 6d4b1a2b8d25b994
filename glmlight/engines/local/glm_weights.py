"""The GLM-5 runner's view of the weights: per layer, the model's own parameters fused into the
few matrices a decode step multiplies by (read again after every weight update).

- q_a | kv_a latent | kv_a rope | indexer wk | indexer weights_proj as one input matrix (all read
  the normalised layer input), rotary halves de-interleaved so that RoPE works on contiguous
  halves (models whose RoPE rotates halves already, Glm4MoeLite with `rope_interleave=false`, keep
  their order); q_b with the indexer's q rows beside it (a model without DSA indexers, Glm4MoeLite:
  none);
- MLA weight absorption, on small models: kv_b_proj's key half folded into q_b_proj and its
  value half into o_proj, so attention runs in the latent space without extra matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from glmlight.models.glm5.moe import Stacked, stacked_experts


@dataclass
class Layer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    w_in: torch.Tensor  # [q_a | kv_a latent | kv_a rope (de-interleaved) | indexer wk (rope half
    #                      de-interleaved) | indexer weights_proj]
    b_in: torch.Tensor | None
    split_in: list[int]
    q_norm: torch.Tensor
    q_eps: float
    kv_norm: torch.Tensor
    kv_eps: float
    w_qb: torch.Tensor  # [q nope (H) | indexer q pass (Hi) | q rope (H) | indexer q rope (Hi)], rope de-interleaved
    split_qb: list[int]
    w_uk: torch.Tensor | None  # [H, nope, L]: key half of kv_b_proj (None: absorbed into w_qb)
    w_uv: torch.Tensor | None  # [H, L, dv]: value half of kv_b_proj (None: absorbed into o_proj)
    o_proj: torch.Tensor  # [hidden, H * dv], or [hidden, H * L] with w_uv absorbed
    o_bias: torch.Tensor | None
    scaling: float
    indexer: Any  # the layer's GlmMoeDsaIndexer module, or None for "shared" layers and models without DSA
    k_ln: tuple[torch.Tensor | None, torch.Tensor | None, float] | None  # indexer k_norm, de-interleaved
    mlp: torch.nn.Module
    gate_up: torch.Tensor | None  # dense MLP: [2m, h]
    down: torch.Tensor | None  # dense MLP: [h, m]
    moe: bool
    experts: Stacked | None  # moe.stacked_experts


def deinterleave(r: int) -> torch.Tensor:
    return torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2)])


def read_layers(model: torch.nn.Module, *, absorb_q: bool, absorb_o: bool, layers: Any = None) -> list[Layer]:
    """One `Layer` per decoder layer of a GlmMoeDsaForCausalLM (or Glm4MoeLiteForCausalLM), from its current
    parameters; or per layer of `layers` (modules of the model's layer structure: its MTP layers' blocks).
    Weights the model holds in FP8 (`glmlight.models.fp8`) are read dequantised, once (`fp8_view`)."""
    with fp8_view():
        return _read_layers(model, model.model.layers if layers is None else layers, absorb_q=absorb_q,
                            absorb_o=absorb_o)


def fp8_view():
    """While open, each FP8-held weight is dequantised once however often it is read (the fused
    matrices then hold Q·s in the model's dtype: the same numbers a matmul that dequantises its
    FP8 operand multiplies by)."""
    from torch.nn.utils import parametrize

    return parametrize.cached()


def _read_layers(model: torch.nn.Module, decoder_layers: Any, *, absorb_q: bool, absorb_o: bool) -> list[Layer]:
    cfg = model.config
    device = next(model.parameters()).device
    H, L, r, dv = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
    nope = cfg.qk_nope_head_dim
    # GLM-5 always rotates interleaved pairs; Glm4MoeLite as its config says
    perm = (deinterleave(r) if getattr(cfg, "rope_interleave", True) else torch.arange(r)).to(device)
    layers: list[Layer] = []
    for layer in decoder_layers:
        a, ix = layer.self_attn, getattr(layer.self_attn, "indexer", None)
        kv_a = a.kv_a_proj_with_mqa.weight
        ws = [a.q_a_proj.weight, kv_a[:L], kv_a[L:][perm]]
        bs = [a.q_a_proj.bias, *(a.kv_a_proj_with_mqa.bias.split([L, r]) if a.kv_a_proj_with_mqa.bias is not None
                                 else (None, None))]
        qb = a.q_b_proj.weight.view(H, nope + r, -1)
        kv_b = a.kv_b_proj.weight.view(H, nope + dv, L)
        w_uk, w_uv, o_proj = kv_b[:, :nope], kv_b[:, nope:].transpose(1, 2), a.o_proj.weight
        q_nope, q_rot = qb[:, :nope].reshape(H * nope, -1), qb[:, nope:][:, perm].reshape(H * r, -1)
        if absorb_q:  # q_lat = q_resid W_qb,nope W_uk: one [H * L, q_lora] matrix
            q_nope = torch.einsum("hnl,hnq->hlq", w_uk.float(), qb[:, :nope].float()).reshape(H * L, -1)
            q_nope, w_uk = q_nope.to(qb.dtype), None
        if absorb_o:  # o_proj(o_lat W_uv): one [hidden, H * L] matrix
            o_proj = torch.einsum("ehd,hld->ehl", o_proj.view(-1, H, dv).float(), w_uv.float())
            o_proj, w_uv = o_proj.reshape(o_proj.shape[0], H * L).to(qb.dtype), None
        qbs, k_ln = [q_nope], None
        if ix is not None:
            ipm = torch.cat([perm, torch.arange(r, ix.head_dim, device=device)])
            ws += [ix.wk.weight[ipm], ix.weights_proj.weight]  # both read the normalised input too
            bs += [None, None]
            iq = ix.wq_b.weight.view(ix.n_heads, ix.head_dim, -1)
            qbs = [q_nope, iq[:, r:].reshape(-1, iq.shape[-1]), q_rot, iq[:, :r][:, perm].reshape(-1, iq.shape[-1])]
            ln = ix.k_norm
            k_ln = (ln.weight[ipm] if ln.weight is not None else None,
                    ln.bias[ipm] if ln.bias is not None else None, ln.eps)
        else:
            qbs.append(q_rot)
        b_in = None
        if any(b is not None for b in bs):
            b_in = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(bs, ws)])
        moe = hasattr(layer.mlp, "experts")
        gate_up = stacked = down = None
        if moe:
            stacked = stacked_experts(layer.mlp)
        else:
            gate_up = torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight])
            down = layer.mlp.down_proj.weight
        layers.append(Layer(
            in_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
            w_in=torch.cat(ws), b_in=b_in, split_in=[w.shape[0] for w in ws],
            q_norm=a.q_a_layernorm.weight, q_eps=a.q_a_layernorm.variance_epsilon,
            kv_norm=a.kv_a_layernorm.weight, kv_eps=a.kv_a_layernorm.variance_epsilon,
            w_qb=torch.cat(qbs), split_qb=[w.shape[0] for w in qbs],
            w_uk=None if w_uk is None else w_uk.contiguous(), w_uv=None if w_uv is None else w_uv.contiguous(),
            o_proj=o_proj, o_bias=a.o_proj.bias, scaling=a.scaling, indexer=ix, k_ln=k_ln,
            mlp=layer.mlp, gate_up=gate_up, down=down, moe=moe, experts=stacked))
    return layers
