"""A faster training forward for GlmMoeDsaForCausalLM (GLM-5 architecture).

`forward_logits(model, input_ids, attention_mask, position_ids, start)` computes the logits of
`model(input_ids=..., attention_mask=..., position_ids=..., use_cache=False).logits[:, start:]` at
every real (attention_mask = 1) position, from the model's own parameters and with autograd:
gradients reach the parameters exactly as through the model's forward (the DSA indexer runs
without gradients there and here). Logits at padding positions are 0.

Per layer (GLM-5 = DeepSeek-V3.2 MLA + DSA attention, then a dense MLP or a MoE with a shared expert):

    x = rms(h);  q_resid = rms(x W_qa);  [c_kv | k_rope] = x W_kva
    q = q_resid W_qb;  [k_nope | v] = rms(c_kv) W_kvb                 (MLA, expanded per head)
    RoPE on q_rope and the shared k_rope (interleaved pairs)
    a = softmax(q·k * scaling + mask) v          (mask: causal, key padding, DSA top-k selection)
    h = h + a W_o;  h = h + MLP(rms(h))

Why it is faster than the model's forward on CPU, for the batches of RL training:

- every per-token computation (norms, projections, MLP/MoE, LM head) runs on the real tokens
  only, packed [N, hidden]; only attention works on the padded [B, S] layout. Two autograd
  functions with hand-written backward passes move queries, keys and values into it (scatter,
  RoPE as one complex multiplication, head-major layout) with one copy each way;
- the last layer and the LM head only run the queries of the returned positions (>= start);
- one additive mask is built per forward and shared by the layers; a DSA layer only adds its
  top-k selection, and only when the sequence is longer than the top-k; attention is the masked
  SDPA kernel on it;
- the DSA indexer scores chunks of queries against the keys up to the chunk's end only (the later
  ones are causally masked anyway), its head sum is a few fused multiply-adds instead of a
  [1, H] x [H, S] batched matmul per query, its top-k tie rule costs one cumulative sum, and
  queries with at most k allowed keys (the first k positions) skip it;
- RMSNorm with a hand-written backward (fewer passes over memory than autograd's);
- q_a | kv_a as one matmul on concatenated weights (autograd splits the gradient back onto the
  model's parameters); the MoE's routed experts as one grouped matmul per projection over the
  tokens sorted by expert, the shared expert as a dense MLP.

`forward_logits_mtp` also returns the logits of the model's multi-token prediction layers
(`glmlight/models/mtp.py`), each depth's block run by the same `_layer` over the positions that have its input.

Replay (`replay=`, `glmlight/models/glm5/replay.py`): the engine's recorded experts replace the
router's top-k (the router's weights of those experts are still computed, with gradients) and its
recorded DSA keys replace the indexer's top-k; `replay.capture` receives the choices used.

Deviations from the model's function: among DSA index scores that tie exactly at the top-k
cut-off, the most recent positions are selected (`glmlight.ops.dsa`, the engine's rule)
where `Tensor.topk` leaves the choice unspecified; in bf16, RoPE is computed in fp32 and rounded
once; logits at padding positions are 0 (no real position depends on them, in the model either).
Everything else agrees up to float reassociation (~1e-6 in fp32).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F

from glmlight.ops.dsa import topk_mask
from glmlight.ops.mtp import mtp_input
from glmlight.models.experts import sorted_experts
from glmlight.models.glm5.arch import is_glm5
from glmlight.models.glm5.moe import route
from glmlight.models.glm5.replay import Replay, columns_from_selection, selection_from_columns

# The DSA indexer scores the queries in this many chunks, each against the keys up to its last query.
INDEX_QUERY_CHUNKS = 4


def supports(model: torch.nn.Module) -> bool:
    """Whether `model` is a GlmMoeDsaForCausalLM whose forward this module reproduces."""
    if not is_glm5(model):
        return False
    cfg = model.config
    # complex views of the rotary pairs need even offsets; grouped matmuls need 16-byte rows
    even = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.q_lora_rank, cfg.index_head_dim)
    return (cfg.num_key_value_heads == cfg.num_attention_heads and cfg.indexer_types[0] == "full"
            and all(d % 2 == 0 for d in even) and cfg.hidden_size % 8 == 0 and cfg.moe_intermediate_size % 8 == 0
            and not getattr(model, "is_activation_checkpointing", False))


class _Block:
    """The real tokens among the query positions q0..S-1 of a [B, S] batch: `flat` = b * (S - q0) + s - q0
    of each, in order, and `pick` = their indices among the packed real tokens (None: all of them)."""

    def __init__(self, real: torch.Tensor, rows: torch.Tensor, q0: int):
        B, S = real.shape
        self.real, self.rows, self.q0, self.B, self.n = real, rows, q0, B, S - q0
        s = rows % S
        self.pick = None if q0 == 0 else (s >= q0).nonzero().squeeze(1)
        self.flat = rows if q0 == 0 else (rows // S * self.n + s - q0).index_select(0, self.pick)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of packed x [N, ...] that are in this block."""
        return x if self.pick is None else x.index_select(0, self.pick)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """This block's packed rows [n, ...] -> [B * (S - q0), ...], zeros at padding."""
        return x.new_zeros(self.B * self.n, *x.shape[1:]).index_copy_(0, self.flat, x)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S - q0, ...] -> this block's packed rows [n, ...]."""
        return x.reshape(self.B * self.n, *x.shape[2:]).index_select(0, self.flat)


def forward_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   position_ids: torch.Tensor, start: int = 0, replay: Replay | None = None) -> torch.Tensor:
    """Logits [B, S - start, V] of `model` at positions start..S-1, 0 at padding (see the module docstring).
    `replay`: the engine's expert and DSA choices to use instead of the router's and the indexer's
    (`glmlight.models.glm5.replay`), and/or a capture of the choices used."""
    return _as_forward(model, _logits, input_ids, attention_mask, position_ids, start, replay, None)


def forward_logits_mtp(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       position_ids: torch.Tensor, start: int = 0,
                       replay: Replay | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`forward_logits`, and the logits of each of the model's MTP depths d = 1..D (`glmlight.models.mtp`)
    [B, S - start, V] at positions start-d..S-1-d (0 where a position is padding, before the sequence, or has
    no token d ahead): entry i of every depth predicts the token entry i of the main logits predicts, token
    start + i + 1, depth d from position start - d + i.

    Depth d's block runs over every real position t that has a token t + d, on the input
    `glmlight.ops.mtp.mtp_input(embedding of token t + d, h^{d-1}_t)`: h^0 the main model's last hidden state
    after its final norm (what its output head reads; SGLang's and vLLM's MTP drafts and Megatron's MTP
    training take the same), h^d the depth's output after its `shared_head.norm`. The main model's hidden
    states, the embedding and the output head enter detached: the MTP logits' gradient reaches the MTP
    layers only. The MTP blocks route and select keys on their own (no replay: the engine runs no MTP).
    For the MTP layers' keys the main model's last layer runs every position, not only those >= start."""
    out: list[torch.Tensor] = []
    logits = _as_forward(model, _logits, input_ids, attention_mask, position_ids, start, replay, out)
    return logits, out


@dataclass
class _Step:
    """What every layer of one forward shares."""

    real: torch.Tensor  # [B, S] attention mask as bool
    rows: torch.Tensor  # flat indices of the real tokens
    position_ids: torch.Tensor
    rot: torch.Tensor
    rot_p: torch.Tensor
    allowed: torch.Tensor
    bias: torch.Tensor
    keys: _Block
    training: bool
    replay: Replay | None


def _logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            position_ids: torch.Tensor, start: int, replay: Replay | None,
            mtp_out: list[torch.Tensor] | None) -> torch.Tensor:
    m = model.model
    B, S = input_ids.shape
    real = attention_mask.bool()
    rows = real.flatten().nonzero().squeeze(1)  # the real tokens, packed: h is [N, hidden]
    h = m.embed_tokens(input_ids.flatten().index_select(0, rows))
    rot = _rotation(*m.rotary_emb(h, position_ids.expand(B, S)))  # [B, S, 1, r/2]
    rot_p = rot.flatten(0, 1).index_select(0, rows)  # [N, 1, r/2]
    # allowed[b, i, j]: query i may attend key j (causal, key not padding)
    allowed = torch.ones(S, S, dtype=torch.bool, device=h.device).tril_() & real[:, None, :]
    bias = _bias(allowed, h.dtype)
    keys = _Block(real, rows, 0)
    step = _Step(real, rows, position_ids, rot, rot_p, allowed, bias, keys, model.training, replay)
    layer_bias = bias  # a "shared" layer reuses the mask of the previous layer (its DSA selection)
    returned = _Block(real, rows, start)
    for i, layer in enumerate(m.layers):
        # the last layer only runs the queries of the returned positions (every one for the MTP layers' keys)
        queries = returned if i == len(m.layers) - 1 and mtp_out is None else keys
        h, layer_bias = _as_forward(layer, _layer, i, h, layer_bias, queries, step)
    h = _norm(h, m.norm)
    if mtp_out is not None:
        mtp_out.extend(_mtp_logits(model, h.detach(), input_ids, start, step))
        h = returned(h)
    return returned.scatter(model.lm_head(h)).view(B, S - start, -1)


def _mtp_logits(model: torch.nn.Module, h: torch.Tensor, input_ids: torch.Tensor, start: int,
                st: _Step) -> list[torch.Tensor]:
    """The MTP depths' logits of `forward_logits_mtp`, from the main model's normed last hidden state h [N, H]
    (packed over `st.rows`, detached)."""
    m, mtp = model.model, model.mtp
    B, S = st.real.shape
    emb_w, head_w = m.embed_tokens.weight.detach(), model.lm_head.weight.detach()
    ids = input_ids.flatten()
    tril = torch.ones(S, S, dtype=torch.bool, device=h.device).tril_()
    out = []
    prev = _Block(st.real, st.rows, 0).scatter(h)  # [B * S, H]
    for d, layer in enumerate(mtp.layers, start=1):
        real = torch.zeros_like(st.real)
        real[:, : S - d] = st.real[:, : S - d] & st.real[:, d:]  # position t has a token t + d
        rows = real.flatten().nonzero().squeeze(1)
        x = mtp_input(F.embedding(ids.index_select(0, rows + d), emb_w), prev.index_select(0, rows),
                      layer.enorm.weight, layer.hnorm.weight, layer.eh_proj.weight, layer.enorm.variance_epsilon)
        allowed = tril & real[:, None, :]
        bias = _bias(allowed, x.dtype)
        keys = _Block(real, rows, 0)
        step = _Step(real, rows, st.position_ids, st.rot, st.rot.flatten(0, 1).index_select(0, rows), allowed,
                     bias, keys, st.training, None)
        y, _ = _as_forward(layer, _layer, mtp.first_layer + d - 1, x, bias, keys, step)
        y = _norm(y, layer.shared_head.norm)
        prev = keys.scatter(y)
        # entry i of the window is position start - d + i
        pos = rows % S
        sel = (pos >= start - d).nonzero().squeeze(1)
        flat = (rows // S * (S - start) + pos - (start - d)).index_select(0, sel)
        z = F.linear(y.index_select(0, sel), head_w)
        out.append(z.new_zeros(B * (S - start), z.shape[-1]).index_copy_(0, flat, z).view(B, S - start, -1))
    return out


def _layer(layer: torch.nn.Module, i: int, h: torch.Tensor, layer_bias: torch.Tensor | None, queries: _Block,
           st: _Step) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decoder layer i: attention (MLA + DSA), then the MLP or MoE, both with residuals; with replay,
    the engine's DSA keys and experts, and/or a capture of the ones used."""
    replay, real = st.replay, st.real
    B, S = real.shape
    a = layer.self_attn
    replayed = on_select = None
    if a.indexer is not None:  # a "full" layer: every allowed key is selected unless S > top-k
        k = a.indexer.index_topk
        layer_bias = st.bias if S <= k else None
        if replay is not None and S > k:
            rows_k = real & (st.position_ids.expand(B, S) >= k)  # the queries that select (in this block)
            rows_k[:, : queries.q0] = False
            if i in replay.index:
                cols = replay.index[i]
                # queries without a record (a sequence's last token) keep the indexer's own choice
                replayed = (cols, bool((rows_k & (cols[..., 0] < 0)).any()))
            if replay.capture is not None:
                on_select = lambda sel: replay.record("index", i, columns_from_selection(sel, rows_k, k))  # noqa: E731
    out, layer_bias = _attention(a, _norm(h, layer.input_layernorm), st.rot, st.rot_p, st.allowed, layer_bias,
                                 st.keys, queries, st.training, replayed, on_select)
    h = queries(h) + out
    forced = None
    if replay is not None and i in replay.experts:
        forced = queries(replay.experts[i].flatten(0, 1).index_select(0, st.rows))
    y, idx = _mlp(layer.mlp, _norm(h, layer.post_attention_layernorm), forced)
    h = h + y
    if replay is not None and replay.capture is not None and idx is not None:
        # [B, S, k], -1 at padding and before the block
        used = (queries.scatter(idx + 1) - 1).view(B, S - queries.q0, -1)
        replay.record("experts", i, F.pad(used, (0, 0, queries.q0, 0), value=-1))
    return h, layer_bias


def _as_forward(module: torch.nn.Module, fn, *args):
    """fn(module, *args); for an FSDP2-sharded module (`fully_shard`) run as the module's forward, so
    that its hooks gather its parameters before, free them after and reduce their gradients in
    backward, exactly as around the module's own forward."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return fn(module, *args)
    module.forward = functools.partial(fn, module)  # shadows the class's forward for this one call
    try:
        return module(*args)
    finally:
        del module.forward


# ----------------------------------------------------------------- elementwise pieces
class _RMSNorm(torch.autograd.Function):
    """GlmMoeDsaRMSNorm, w * (x / rms(x)) normalised in fp32 and scaled in x's dtype, with a
    hand-written backward (fewer passes over memory than autograd's through the ops)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        xhat = (xf * rstd).to(x.dtype)
        ctx.save_for_backward(xhat, w, rstd)
        return w * xhat

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        xhat, w, rstd = ctx.saved_tensors
        dw = (dy * xhat).float().sum(tuple(range(dy.dim() - 1))).to(w.dtype)
        g, xh = (dy * w).float(), xhat.float()
        # d(x · rstd(x)) = rstd · (g - x̂ · mean(g · x̂))
        c = torch.linalg.vecdot(g, xh).unsqueeze_(-1).div_(xh.shape[-1])
        return torch.addcmul(g, xh, c, value=-1).mul_(rstd).to(dy.dtype), dw, None


def _norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    return _RMSNorm.apply(x, norm.weight, norm.variance_epsilon)


def _bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask [B, 1, S, S]: 0 where allowed, else the dtype's min (as the model's
    masks: a fully masked padding query row stays finite)."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


def _rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of every position as a complex [B, S, 1, r/2] (fp32, or fp64 for fp64 models), from the model's
    rotary embedding: cos/sin [B, S, r] of cat(freqs, freqs), yarn scaling included."""
    half = cos.shape[-1] // 2
    real = torch.float64 if cos.dtype == torch.float64 else torch.float32
    return torch.complex(cos[..., None, :half].to(real), sin[..., None, :half].to(real))


def _pairs(x: torch.Tensor) -> torch.Tensor:
    return torch.view_as_complex(x.unflatten(-1, (-1, 2)))


def _rotate_(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Rotates, in place, the interleaved pairs (x0, x1), (x2, x3), ... of x [..., r] by rot [..., r/2]
    (broadcast): the interleaved RoPE of GLM-5. The model's `apply_rotary_pos_emb_interleave` returns
    the same pairs with the real parts first; queries and keys both keep them interleaved here, so
    their dot products are the model's. x may be a strided view (even offsets and strides)."""
    if x.dtype == rot.real.dtype:
        torch.mul(_pairs(x), rot, out=_pairs(x))
    else:
        x.copy_(torch.view_as_real(_pairs(x.to(rot.real.dtype)) * rot).flatten(-2))
    return x


class _Query(torch.autograd.Function):
    """The packed q_b projection [n, H, nope + r] -> SDPA's query [B, H, S', nope + r] (RoPE on the last
    r dims, zeros at padding) with one scatter and an in-place rotation; back: a gather and a rotation."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, rot: torch.Tensor, block: _Block, nope: int) -> torch.Tensor:
        rot = rot.reshape(-1, *rot.shape[2:])  # the block's positions, [B * S', 1, r/2]
        out = block.scatter(q)
        _rotate_(out[..., nope:], rot)
        ctx.save_for_backward(rot)
        ctx.block, ctx.nope = block, nope
        return out.view(block.B, block.n, *q.shape[1:]).transpose(1, 2)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (rot,), block, nope = ctx.saved_tensors, ctx.block, ctx.nope
        dq = block.gather(g.transpose(1, 2))
        _rotate_(dq[..., nope:], rot.index_select(0, block.flat).conj())
        return dq, None, None, None


class _KeyValue(torch.autograd.Function):
    """The packed kv_b projection [N, H, nope + dv] and shared rotary key [N, r] -> SDPA's key
    [B, H, S, nope + r] (RoPE on the shared part, broadcast over heads) and value [B, H, S, dv], zeros
    at padding, with one scatter each; back: one gather each."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, k_rope: torch.Tensor, rot: torch.Tensor, block: _Block,
                nope: int) -> tuple[torch.Tensor, torch.Tensor]:
        N, H, _ = kv.shape
        r = k_rope.shape[-1]
        k = kv.new_zeros(block.B * block.n, H, nope + r)
        k[..., :nope].index_copy_(0, block.flat, kv[..., :nope])
        k[..., nope:].index_copy_(0, block.flat, _rotate_(k_rope[:, None].clone(), rot).expand(N, H, r))
        v = block.scatter(kv[..., nope:])
        ctx.save_for_backward(rot)
        ctx.block, ctx.nope = block, nope
        return (k.view(block.B, block.n, H, -1).transpose(1, 2), v.view(block.B, block.n, H, -1).transpose(1, 2))

    @staticmethod
    def backward(ctx, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
        (rot,), block, nope = ctx.saved_tensors, ctx.block, ctx.nope
        dk = block.gather(dk.transpose(1, 2))
        dkv = torch.cat([dk[..., :nope], block.gather(dv.transpose(1, 2))], dim=-1)
        return dkv, _rotate_(dk[..., nope:].sum(1), rot[:, 0].conj()), None, None, None


# ----------------------------------------------------------------- attention
def _attention(a: torch.nn.Module, x: torch.Tensor, rot: torch.Tensor, rot_p: torch.Tensor, allowed: torch.Tensor,
               bias: torch.Tensor | None, keys: _Block, queries: _Block, training: bool,
               replayed: tuple[torch.Tensor, bool] | None = None, on_select=None) -> tuple[torch.Tensor, torch.Tensor]:
    """GlmMoeDsaAttention for the packed tokens x [N, hidden]: the outputs of the `queries` block's tokens,
    and the additive mask [B, 1, S, S] used (rows before the block not meaningful). `bias` is the mask
    to use, or None: this layer selects its keys, with its DSA indexer or as `replayed` = (key columns
    [B, S, k] from records, -1 rows: the indexer's; whether any selecting query has no record), and
    hands the selection to `on_select`. rot/rot_p: RoPE [B, S, 1, r/2] and packed [N, 1, r/2]."""
    H, nope, r = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim
    qa, kva = a.q_a_proj, a.kv_a_proj_with_mqa
    b_in = None if qa.bias is None and kva.bias is None else torch.cat(
        [p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in (qa, kva)])
    q_resid, c_kv, k_rope = F.linear(x, torch.cat([qa.weight, kva.weight]), b_in).split(
        [a.q_lora_rank, a.kv_lora_rank, r], dim=-1)
    q_resid = _norm(q_resid, a.q_a_layernorm)
    if bias is None:
        with torch.no_grad():
            own = None
            if replayed is None or replayed[1]:
                own = _select(a.indexer, x, q_resid, rot_p, allowed, keys, queries.q0)
            selected = own if replayed is None else selection_from_columns(allowed, replayed[0], own)
            if on_select is not None:
                on_select(selected)
            bias = _bias(selected, x.dtype)
    q = F.linear(queries(q_resid), a.q_b_proj.weight).view(-1, H, nope + r)
    q = _Query.apply(q, rot[:, queries.q0:], queries, nope)
    kv = F.linear(_norm(c_kv, a.kv_a_layernorm), a.kv_b_proj.weight).view(-1, H, nope + a.v_head_dim)
    k, v = _KeyValue.apply(kv, k_rope, rot_p, keys, nope)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, :, queries.q0:], scale=a.scaling,
                                       dropout_p=a.attention_dropout if training else 0.0)
    return F.linear(queries.gather(o.transpose(1, 2)).flatten(1), a.o_proj.weight, a.o_proj.bias), bias


def _select(ix: torch.nn.Module, x: torch.Tensor, q_resid: torch.Tensor, rot_p: torch.Tensor,
            allowed: torch.Tensor, keys: _Block, q0: int) -> torch.Tensor:
    """DSA lightning indexer (DeepSeek-V3.2; interleaved RoPE as GLM-5): index[i, j] =
    Σ_h w_h(x_i) · relu(q_h(i)·k(j) / sqrt(d)) over the allowed keys j; returns `allowed` restricted
    to the top-k keys of the queries at positions q0.. (ties at the cut-off to the most recent keys).
    Queries before position k have at most k allowed keys, all selected, so they are skipped."""
    k, Hi, Di, r = ix.index_topk, ix.n_heads, ix.head_dim, ix.qk_rope_head_dim
    block = _Block(keys.real, keys.rows, max(q0, k))
    B, n, S = block.B, block.n, keys.n
    wp = ix.weights_proj.weight
    weights = F.linear(block(x).to(wp.dtype), wp).float() * (Hi**-0.5 * ix.softmax_scale)
    weights = block.scatter(weights).view(B, n, Hi)
    key = F.layer_norm(F.linear(x, ix.wk.weight), (Di,), ix.k_norm.weight, ix.k_norm.bias, ix.k_norm.eps)
    _rotate_(key[:, :r], rot_p[:, 0])
    q = F.linear(block(q_resid), ix.wq_b.weight).view(-1, Hi, Di)
    _rotate_(q[..., :r], block(rot_p))
    q = block.scatter(q).view(B, n, Hi, Di).float()
    key = keys.scatter(key).view(B, S, Di).float()
    selected = allowed.clone()
    # queries in [lo, hi) only have allowed keys before hi: chunks of queries, each scored against the
    # keys up to its end only
    bounds = sorted({block.q0 + (S - block.q0) * c // INDEX_QUERY_CHUNKS for c in range(INDEX_QUERY_CHUNKS + 1)})
    for lo, hi in pairwise(bounds):
        part = slice(lo - block.q0, hi - block.q0)
        scores = torch.bmm(q[:, part].flatten(1, 2), key[:, :hi].transpose(1, 2)).view(B, hi - lo, Hi, hi).relu_()
        # Σ_h over a handful of heads: a loop of fused multiply-adds beats a batched [1, Hi] @ [Hi, S] matmul
        w = weights[:, part]
        index = scores[:, :, 0] * w[..., 0, None]
        for h in range(1, Hi):
            index.addcmul_(scores[:, :, h], w[..., h, None])
        index.masked_fill_(~allowed[:, lo:hi, :hi], float("-inf"))
        selected[:, lo:hi, :hi] &= topk_mask(index, k)
    return selected


# ----------------------------------------------------------------- MLP / MoE
def _mlp(mlp: torch.nn.Module, x: torch.Tensor,
         forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GlmMoeDsaMLP, or GlmMoeDsaMoE, of packed tokens x [N, hidden]; and the MoE's expert ids [N, k]
    (None for a dense MLP). `forced`: replayed expert ids [N, k] (`moe.route`)."""
    if hasattr(mlp, "experts"):
        return _moe(mlp, x, forced)
    return F.linear(F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight),
                    mlp.down_proj.weight), None


def _moe(mlp: torch.nn.Module, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """GlmMoeDsaMoE: the routed experts (sigmoid router, top-k, `moe.route`; `experts.sorted_experts`: the
    tokens sorted by expert, one grouped matmul per projection) added onto the shared expert, a dense MLP."""
    w, idx = route(mlp.gate, x, forced)
    return sorted_experts(mlp.experts, x, idx, w, out=_mlp(mlp.shared_experts, x)[0]), idx
