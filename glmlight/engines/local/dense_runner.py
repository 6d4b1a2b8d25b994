"""Fast decoding of dense-attention models for the embedded engine: the Llama family (Llama, Mistral, Qwen2, Qwen3)
and GLM-4.5 / 4.6 / 4.7 (Glm4Moe: the same grouped-query attention, half-rotary RoPE, then a dense MLP or a MoE).

The runner computes the same function as the model's own forward, from the model's own weights, with
a layout made for continuous batching (the layout of the GLM-5 runner, `glm_runner.py`):

- a preallocated per-row key/value cache per layer, `[rows, kv_heads, capacity, head_dim]`. Row `r`
  holds its own sequence at positions `0..len_r-1`; nothing is shared between rows. Its numbers equal
  those of the row alone up to float32 rounding of the batched matmuls (attention's, and `F.linear`'s
  where weights are not packed): prefill logits of 5 ragged prompts together against one at a time
  differ by up to 1.5e-7 on the tiny Llama of tests/unit/engines/test_dense_runner.py, packed or not;
  greedy tokens agree there, but a near-tied logit can fall either way.
- `admit` prefills newcomers straight into free rows at the end of the batch (causal attention over
  their right-padded prompts, which never sees the padding); `step` decodes one token for every row;
  `keep` compacts the rows that survive.
- few tensor ops per step: the query, key and value projections fused into one matrix, gate and up into
  another; one rotary table (the model's own rotary embedding, so any rope scaling it has is kept);
  cache writes by flat `index_copy_`; grouped-query attention by one batched matmul per side, without
  repeating the key/value heads.
- eager float32 decoding on CPU runs the projections and the LM head through oneDNN with weights
  reordered once per `refresh` (`packed.py`: 1.2-2.2x faster than `F.linear` at decode's few rows on the
  2-core EPYC); `pack=False` keeps `F.linear`.
- `compile=True`: a decode step, with the sampler `step` is given, runs as one `torch.compile`d graph
  over a window of the cache rounded up to whole `DECODE_WINDOW` blocks (as the GLM-5 runner's; the
  batch size, the window and the cache size are symbols of one graph). Prefill stays eager.

What it reads: embed_tokens, every layer's input/post-attention RMSNorm, q/k/v/o projections (with
biases where the model has them: Qwen2's q/k/v, Llama's and Glm4Moe's `attention_bias`), Qwen3's and Glm4Moe's
per-head q/k RMSNorm, the SiLU-gated MLP, the final norm and lm_head. RoPE rotates the first `rotary_dim` of each
head (Glm4Moe's `partial_rotary_factor`: half) and passes the rest. Glm4Moe's MoE layers (router with a
correction bias and expert groups, routed experts, shared expert) run `glmlight/models/glm5/moe.py`, the GLM-5
runner's MoE: the same module in transformers. `supports(model)` accepts only models this reproduces exactly: full
attention in every layer (no sliding window), SiLU, no MLP bias, `pretraining_tp = 1`.

Replay capture (`set_capture`, `records`): the expert ids of every MoE layer, per row and position beside the
cache (`glmlight/engines/local/records.py`), as the GLM-5 runner records them.

Numerics: the same fp32 function as the model's forward up to reassociation (fused matmuls, another
attention kernel): logits agree to ~1e-5.

Weights are read from the model on `refresh()` (reading `module.weight`, so FP8-held weights come
dequantised); the engine calls it after every weight update.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from glmlight.engines.local import packed as packing
from glmlight.engines.local.records import Capture
from glmlight.engines.local.rows import DECODE_WINDOW, RowCache, _dynamic, _map_tensors, compile_decode, head_weights
from glmlight.models.glm5.moe import Stacked, moe_forward, moe_forward_routed, stacked_experts

log = logging.getLogger(__name__)

FAMILY = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
          "Qwen3ForCausalLM": "qwen3", "Glm4MoeForCausalLM": "glm4_moe"}


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why this runner cannot reproduce `model` (None: it can)."""
    name = type(model).__name__
    if name not in FAMILY:
        return f"{name} is not one of {', '.join(sorted(FAMILY))}"
    cfg = model.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act={cfg.hidden_act!r} (only silu)"
    if getattr(cfg, "mlp_bias", False):
        return "mlp_bias=true"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return f"pretraining_tp={cfg.pretraining_tp}"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if name == "Glm4MoeForCausalLM" and "dynamic" in rope:
        return f"rope_type={rope!r}"
    types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in types):
        return "sliding-window layers"
    if getattr(cfg, "use_sliding_window", False) or (name == "MistralForCausalLM" and getattr(cfg, "sliding_window", None)):
        return "sliding-window attention"
    attn = model.model.layers[0].self_attn
    if getattr(attn, "sliding_window", None):
        return "sliding-window attention"
    return None


def supports(model: torch.nn.Module) -> bool:
    return unsupported_reason(model) is None


@dataclass
class DenseLayer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    w_qkv: torch.Tensor | None  # [(H + 2 Hkv) D, hidden]; None once packed
    b_qkv: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3: per-head RMSNorm of queries / keys
    k_norm: torch.Tensor | None
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    gate_up: torch.Tensor | None  # [2 I, hidden]; None once packed (and for a MoE layer)
    down: torch.Tensor | None  # None for a MoE layer
    scaling: float
    # the projections reordered for oneDNN (glmlight/engines/local/packed.py): "qkv", "o", "gate_up", "down"
    packed: dict[str, torch.Tensor] | None = None
    mlp: torch.nn.Module | None = None  # a MoE layer's module (router, experts, shared expert); None: dense MLP
    experts: Stacked | None = None  # its experts stacked (glmlight/models/glm5/moe.py), None where too large


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: normalise in fp32, scale in the model dtype (in fp32: one fused op)."""
    if x.dtype == torch.float32 and w.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate_half RoPE (Llama's apply_rotary_pos_emb); cos/sin broadcast over heads. Partial RoPE (cos/sin
    narrower than the head, Glm4Moe's): the first cos.shape[-1] dimensions rotate, the others pass."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    h = r // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], dim=-1) * sin


class DenseRunner(RowCache):
    """Per-row cached decoding of a dense Llama-family model (see the module docstring)."""

    can_merge = True

    def __init__(self, model: torch.nn.Module, rows: int = 8, capacity: int = 128, compile: bool = False,
                 pack: bool | None = None):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the dense runner cannot run this model: {reason}")
        self.model = model
        self.cfg = cfg = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        attn = model.model.layers[0].self_attn
        self.H, self.Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.D = getattr(attn, "head_dim", None) or getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H
        self.G = self.H // self.Hkv
        self._rope_len = 0
        # eager float32 decoding on CPU reads oneDNN-reordered weights (packed.py); `pack` = False keeps F.linear
        self.pack = (not compile and packing.available(p.detach())) if pack is None else bool(pack)
        self.capture: Capture | None = None  # replay records (set_capture)
        self.refresh()
        self.n = 0
        self.lens = torch.zeros(0, dtype=torch.long, device=self.device)
        self._max_len = 0
        self.rows_cap = self.capacity = 0
        self._alloc(rows, capacity)
        if compile and any(Ly.mlp is not None and Ly.experts is None for Ly in self.layers):
            log.warning("rollout.compile: this model's experts are too large for the compiled decode step's "
                        "dense MoE; decoding eagerly")  # as the GLM-5 runner (its __init__ says why)
            compile = False
        self.compiled = compile
        self._decode = compile_decode(self._decode_window, self.device, compile)

    # ----------------------------------------------------------------- weights
    @torch.inference_mode()
    def refresh(self) -> None:
        """(Re)read the weights from the model; call after every weight update."""
        m = self.model.model
        self.embed, self.final_norm, self.eps, self.lm_head = head_weights(self.model)
        layers = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
            b_qkv = None if all(b is None for b in biases) else torch.cat(
                [b if b is not None else torch.zeros(lin.out_features, dtype=self.dtype, device=self.device)
                 for b, lin in zip(biases, (a.q_proj, a.k_proj, a.v_proj))])
            moe = hasattr(mlp, "experts")
            layers.append(DenseLayer(
                in_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
                w_qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), b_qkv=b_qkv,
                q_norm=a.q_norm.weight if hasattr(a, "q_norm") else None,
                k_norm=a.k_norm.weight if hasattr(a, "k_norm") else None,
                w_o=a.o_proj.weight, b_o=a.o_proj.bias,
                gate_up=None if moe else torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                down=None if moe else mlp.down_proj.weight, scaling=float(a.scaling),
                mlp=mlp if moe else None, experts=stacked_experts(mlp) if moe else None))
        self.head_packed = None
        if self.pack:  # the fused q/k/v and gate/up copies are only kept in their packed form
            for Ly in layers:
                Ly.packed = {k: packing.pack(w) for k, w in
                             (("qkv", Ly.w_qkv), ("o", Ly.w_o), ("gate_up", Ly.gate_up), ("down", Ly.down))
                             if w is not None}
                if Ly.packed["qkv"] is not None:
                    Ly.w_qkv = None
                if Ly.packed.get("gate_up") is not None:
                    Ly.gate_up = None
            self.head_packed = packing.pack(self.lm_head)
        self.layers = layers
        self.qk_eps = m.layers[0].self_attn.q_norm.variance_epsilon if layers[0].q_norm is not None else None
        self._rope_table(max(self._rope_len, 256))

    def _rope_table(self, length: int) -> None:
        pos = torch.arange(length, device=self.device)[None]
        cos, sin = self.model.model.rotary_emb(torch.zeros(1, dtype=self.dtype, device=self.device), pos)
        self._cos, self._sin, self._rope_len = cos[0], sin[0], length  # [length, D]
        self._positions = torch.arange(length, device=self.device)
        _dynamic(self._cos, 0)
        _dynamic(self._sin, 0)

    # ----------------------------------------------------------------- cache
    @torch.inference_mode()
    def _alloc(self, rows: int, capacity: int) -> None:
        n, T = self.n, self._max_len
        shape = (rows, self.Hkv, capacity, self.D)
        K = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        V = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        if self.rows_cap and n:
            for l in range(len(self.layers)):
                K[l][:n, :, :T] = self.K[l][:n, :, :T]
                V[l][:n, :, :T] = self.V[l][:n, :, :T]
        for t in K + V:
            _dynamic(t, 0, 2)
        self.K, self.V = K, V
        self.rows_cap, self.capacity = rows, capacity
        if capacity > self._rope_len:
            self._rope_table(capacity)
        self._alloc_capture(rows, capacity, n, T)

    def _move_rows(self, dst: torch.Tensor, src: torch.Tensor, T: int) -> None:
        for l in range(len(self.layers)):
            self.K[l][dst, :, :T] = self.K[l][src, :, :T]
            self.V[l][dst, :, :T] = self.V[l][src, :, :T]
        if self.capture is not None:
            self.capture.move(dst, src, T)

    # ----------------------------------------------------------------- forward
    @torch.inference_mode()
    def admit(self, prompts: list[list[int]]) -> torch.Tensor:
        """Prefill `prompts` into new rows at the end of the batch; logits of their last tokens [m, V]."""
        ids, lens = self._pad_prompts(prompts)
        logits = self._prefill(ids, self.n, lens - 1)
        self._admitted(lens)
        return logits

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, sample: Any = None) -> Any:
        """Append one token to every row; logits of the next token [n, V], or `sample(logits)` (fused
        into the compiled step)."""
        if self._decode is not None:
            n, lens = self.n, self.lens
            T = -(-(self._max_len + 1) // DECODE_WINDOW) * DECODE_WINDOW
            self._ensure(max(n, 2), T + 1)
            rows = (lambda t: t) if n > 1 else (lambda t: torch.cat([t, t]))
            if n == 1:  # one row would get a graph of its own: decode a scratch row beside it
                tokens, lens = F.pad(tokens, (0, 1)), F.pad(lens, (0, 1))
            sample = None if sample is None else _map_tensors(sample, lambda t: _dynamic(rows(t), 0))
            out = self._decode(_dynamic(tokens, 0), _dynamic(lens, 0), _dynamic(self._positions[:T], 0), sample)
            out = out[:n] if sample is None else tuple(o[:n] for o in out)
        else:
            self._ensure(self.n, self._max_len + 1)
            out = self._decode_step(tokens, self.lens, self._positions[: self._max_len + 1])
            out = out if sample is None else sample(out)
        self.lens = self.lens + 1
        self._max_len += 1
        return out

    def _decode_window(self, tokens: torch.Tensor, lens: torch.Tensor, keys: torch.Tensor, sample: Any) -> Any:
        logits = self._decode_step(tokens, lens, keys)
        return logits if sample is None else sample(logits)

    def _qkv(self, Ly: DenseLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated q [B, S, H, D], k [B, S, Hkv, D] and v [B, S, Hkv, D] of a normalised input [B, S, hidden]."""
        B, S = x.shape[:2]
        H, Hkv, D = self.H, self.Hkv, self.D
        q, k, v = packing.linear(x, Ly.w_qkv, Ly.b_qkv, Ly.packed and Ly.packed["qkv"]).split(
            [H * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.view(B, S, H, D), k.view(B, S, Hkv, D), v.view(B, S, Hkv, D)
        if Ly.q_norm is not None:
            q, k = _rms(q, Ly.q_norm, self.qk_eps), _rms(k, Ly.k_norm, self.qk_eps)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _write(self, l: int, flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, S, Hkv, D] into cache slots `flat` [B * Hkv * S] (row-major over (b, h, s))."""
        D = self.D
        self.K[l].view(-1, D).index_copy_(0, flat, k.transpose(1, 2).reshape(-1, D))
        self.V[l].view(-1, D).index_copy_(0, flat, v.transpose(1, 2).reshape(-1, D))

    def _prefill(self, ids: torch.Tensor, r0: int, last: torch.Tensor) -> torch.Tensor:
        """Prompts ids [B, S] (right-padded) into cache rows r0..r0+B-1; logits at positions `last` [B]."""
        B, S = ids.shape
        Hkv, cap = self.Hkv, self.capacity
        cos, sin = self._cos[:S][None, :, None], self._sin[:S][None, :, None]
        pos = torch.arange(S, device=self.device)
        heads = torch.arange(Hkv, device=self.device)
        rows = torch.arange(r0, r0 + B, device=self.device)
        flat = ((rows[:, None, None] * Hkv + heads[None, :, None]) * cap + pos[None, None, :]).reshape(-1)
        at = (rows[:, None] * cap + pos[None, :]).reshape(-1)  # (row, position) of every token, for records
        h = F.embedding(ids, self.embed)
        for l, Ly in enumerate(self.layers):
            q, k, v = self._qkv(Ly, _rms(h, Ly.in_norm, self.eps), cos, sin)
            self._write(l, flat, k, v)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, scale=Ly.scaling, enable_gqa=self.G > 1)
            h = h + packing.linear(o.transpose(1, 2).reshape(B, S, -1), Ly.w_o, Ly.b_o, Ly.packed and Ly.packed["o"])
            h = h + self._mlp(Ly, _rms(h, Ly.post_norm, self.eps), l, at)
        h = h[torch.arange(B, device=self.device), last]
        return packing.linear(_rms(h, self.final_norm, self.eps), self.lm_head, None, self.head_packed)

    def _decode_step(self, tokens: torch.Tensor, lens: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """One new token per row (rows 0..B-1) at position lens[b]; attention over cache positions `keys`
        = [0, T) (masked past each row's length). Logits [B, V]."""
        B = tokens.shape[0]
        H, Hkv, D, G = self.H, self.Hkv, self.D, self.G
        T, cap = keys.shape[0], self.K[0].shape[2]
        cos, sin = self._cos[lens][:, None, None], self._sin[lens][:, None, None]  # [B, 1, 1, D]
        heads = torch.arange(Hkv, device=self.device)
        rows = torch.arange(B, device=self.device)
        flat = ((rows[:, None] * Hkv + heads[None, :]) * cap + lens[:, None]).reshape(-1)
        at = rows * cap + lens  # (row, position) of every token, for records
        masked = (keys[None, :] > lens[:, None])[:, None, None, :]  # [B, 1, 1, T]: past the row's new token
        h = F.embedding(tokens[:, None], self.embed)  # [B, 1, hidden]
        for l, Ly in enumerate(self.layers):
            q, k, v = self._qkv(Ly, _rms(h, Ly.in_norm, self.eps), cos, sin)
            self._write(l, flat, k, v)
            Kc, Vc = self.K[l][:B, :, :T], self.V[l][:B, :, :T]  # [B, Hkv, T, D]
            qg = q.view(B, Hkv, G, D)
            att = torch.matmul(qg, Kc.transpose(-1, -2)).mul_(Ly.scaling)  # [B, Hkv, G, T]
            att = att.masked_fill_(masked, float("-inf")).softmax(-1, dtype=torch.float32).to(h.dtype)
            o = torch.matmul(att, Vc)  # [B, Hkv, G, D]
            h = h + packing.linear(o.reshape(B, 1, H * D), Ly.w_o, Ly.b_o, Ly.packed and Ly.packed["o"])
            h = h + self._mlp(Ly, _rms(h, Ly.post_norm, self.eps), l, at)
        return packing.linear(_rms(h[:, 0], self.final_norm, self.eps), self.lm_head, None, self.head_packed)

    def _mlp(self, Ly: DenseLayer, x: torch.Tensor, l: int, at: torch.Tensor) -> torch.Tensor:
        """The layer's MLP, or its MoE (whose expert ids go to the records of the tokens at `at` [B * S])."""
        if Ly.mlp is not None:
            if self.capture is None or self.capture.experts is None:
                return moe_forward(Ly.mlp, Ly.experts, x)
            y, idx = moe_forward_routed(Ly.mlp, Ly.experts, x)
            self.capture.experts.write(self._moe_slot[l], at, idx)
            return y
        P = Ly.packed or {}
        g, u = packing.linear(x, Ly.gate_up, None, P.get("gate_up")).chunk(2, dim=-1)
        return packing.linear(F.silu(g) * u, Ly.down, None, P.get("down"))

    # ----------------------------------------------------------------- replay capture
    def set_capture(self, routing: bool, index: bool) -> None:
        """Record (routing) the expert ids of every MoE layer for every token run from now on (rows already
        running have gaps). These models have no DSA indexer: `index` records nothing."""
        moe = [l for l, Ly in enumerate(self.layers) if Ly.mlp is not None]
        self._moe_slot = {l: j for j, l in enumerate(moe)}
        cfg = self.cfg
        self.capture = None if not (routing and moe) else Capture(
            self.device, moe_layers=len(moe), experts_per_tok=cfg.num_experts_per_tok,
            num_experts=cfg.n_routed_experts, indexer_layers=0, index_topk=1, routing=True, index=False)
        self._alloc_capture(self.rows_cap, self.capacity, 0, 0)
