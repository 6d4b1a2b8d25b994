"""Fast decoding of GlmMoeDsa (GLM-5 architecture) models for the embedded engine, and of Glm4MoeLite
(GLM-4.7-Flash: the same MLA attention and MoE, without the DSA indexer; RoPE interleaved or not, as its
`rope_interleave` says).

The runner computes the same function as `GlmMoeDsaForCausalLM.forward` from the
model's own weights, with a layout made for continuous batching:

- a preallocated per-row cache: for every layer the compressed MLA latent
  `[rows, capacity, kv_lora_rank + rope_dim]` (normalised kv latent | rotated
  shared key, as the model caches it) and the DSA indexer keys
  `[rows, capacity, index_dim]`. Attention runs in the latent space (the
  `kv_b_proj` key half is applied to the query, the value half to the attention
  output), so the cache is never re-expanded. Row `r` holds its own sequence at
  positions `0..len_r-1`; nothing is shared between rows. A request's numbers still depend
  on what else is in the batch, by float32 rounding: a batched matmul may round a row
  differently with the number and lengths of the rows computed beside it. Measured on
  the test preset as test_replay.py builds it (index_topk 4, 16 experts top-4), its 6
  prompts prefilled together against
  one at a time: last-token logits within 1.5e-7. On the same model with deliberately
  near-tied routers and indexer keys (`_near_ties` in tests/unit/algorithms/test_replay.py)
  that rounding flips top-k expert and DSA key choices: logits then differ by 0.025, and
  12-token generations (temperature 1, the same seeds) by up to 0.60 in log-prob, with
  other tokens in 5 of 6 rows. What holds: the replay records (below) are the choices this engine made
  for the row in the batch it ran in, and the trainer replays those, so its log-probs
  follow the engine's network path whatever the batch was (test_replay.py's near-tie tests
  run batched).
- `admit` prefills newcomers straight into free rows at the end of the batch;
  `step` decodes one token for every row; `keep` compacts the rows that survive.
- the DSA top-k selection breaks ties between equal index scores by position
  (most recent first), so the selected set depends only on the row's own scores (equal,
  up to the rounding above, to what the row alone computes), never on how long the other rows are.
- a decode step over more than k cached keys attends to the k selected keys only
  (gathered), instead of to every key under a mask.
- few tensor ops per step: fused projections (rows permuted once so that rotary
  halves are contiguous), one rotary table, cache writes by flat `index_copy_`,
  an inline router and, for few tokens, a dense all-experts MoE (`glmlight/models/glm5/moe.py`).

- `compile=True`: a decode step, with the sampler `step` is given, runs as one
  `torch.compile`d graph (elementwise ops fused, Python and dispatch overhead gone; on CPU with
  inductor's C++ wrapper, so the host code between kernels is C++ too). It attends
  over a window of the cache rounded up to whole `DECODE_WINDOW` blocks, under the same masks,
  so shapes change only every 64 steps. The graph is traced with the batch size, the window
  and the cache's size as symbols: one compile serves every step (a batch of one row decodes a
  scratch row beside it; models whose DSA top-k exceeds the first window get a second graph for
  windows past it). Prefill stays eager.

Numerics: the same fp32 function as the model's forward up to reassociation
(latent-space attention, fused matmuls): logits agree to ~1e-6.

Weights are read from the model on `refresh()`; the engine calls it after every
weight update.

Replay capture (`set_capture`, `records`): the expert ids of every MoE layer and the DSA selection of
every layer with its own indexer, per row and position beside the cache (`glmlight/engines/local/records.py`),
also inside a compiled decode step.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from glmlight.models.glm5.arch import glm4_moe_lite_unsupported, is_glm4_moe_lite, is_glm5
from glmlight.models.glm5.moe import moe_forward, moe_forward_routed
from glmlight.ops.dsa import topk_mask, topk_recent
from glmlight.engines.local.glm_weights import Layer, read_layers
from glmlight.engines.local.records import Capture
from glmlight.engines.local.rows import (DECODE_WINDOW, RowCache, _dynamic, _map_tensors,  # noqa: F401 - re-exported
                                         compile_decode, head_weights)

log = logging.getLogger(__name__)

ABSORB_MAX_GROWTH = 1.5


def supports(model: torch.nn.Module) -> bool:
    """Whether `model` is a GlmMoeDsaForCausalLM or a Glm4MoeLiteForCausalLM this runner reproduces exactly."""
    return is_glm5(model) or is_glm4_moe_lite(model)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why this runner cannot reproduce a Glm4MoeLiteForCausalLM (None for any other model)."""
    return glm4_moe_lite_unsupported(model) if type(model).__name__ == "Glm4MoeLiteForCausalLM" else None


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """GlmMoeDsaRMSNorm: normalise in fp32, scale in the model dtype (in fp32: one fused op)."""
    if x.dtype == torch.float32 and w.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on an input whose rotary pairs were de-interleaved into halves
    ([x0, x2, ...| x1, x3, ...]); `cos` = [c | c], `sin` = [-s | s]. The output layout is
    the model's (apply_rotary_pos_emb_interleave)."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., h:], x[..., :h]], dim=-1) * sin


class GlmDsaRunner(RowCache):
    """Per-row cached decoding of a GlmMoeDsaForCausalLM or Glm4MoeLiteForCausalLM (see the module docstring)."""

    can_merge = True

    def __init__(self, model: torch.nn.Module, rows: int = 8, capacity: int = 128, compile: bool = False):
        self.model = model
        self.cfg = cfg = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.H, self.L = cfg.num_attention_heads, cfg.kv_lora_rank
        self.nope, self.rope, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.topk = getattr(cfg, "index_topk", None) or 1  # (a model without DSA indexers never selects)
        # MLA weight absorption (kv_b_proj's halves merged into q_b_proj / o_proj: fewer ops per step)
        # where the merged matrices are at most ABSORB_MAX_GROWTH times the two they replace: small
        # models only (for GLM-5's sizes they would be 2x and more).
        q_lora, hidden = cfg.q_lora_rank, cfg.hidden_size
        self.absorb_q = self.H * self.L * q_lora <= ABSORB_MAX_GROWTH * self.H * self.nope * (q_lora + self.L)
        self.absorb_o = hidden * self.H * self.L <= ABSORB_MAX_GROWTH * self.H * self.dv * (self.L + hidden)
        self._rope_len = 0
        self.capture: Capture | None = None  # replay records (set_capture)
        self.refresh()
        self.n = 0  # rows in the running batch
        self.lens = torch.zeros(0, dtype=torch.long, device=self.device)  # tokens cached per row
        self._max_len = 0
        self.rows_cap = self.capacity = 0
        self._alloc(rows, capacity)
        if compile and any(Ly.moe and Ly.experts is None for Ly in self.layers):
            # Experts too large for the dense all-experts form route with data-dependent shapes, a graph
            # break inside the layer loop: the step would run eagerly after a failed compile, plus per-layer
            # recompiles (measured on the 46M `small` preset: 12% slower than eager, 11 s first step).
            log.warning("rollout.compile: this model's experts are too large for the compiled decode step's "
                        "dense MoE; decoding eagerly")
            compile = False
        self.compiled = compile
        self._decode = compile_decode(self._decode_window, self.device, compile)

    # ----------------------------------------------------------------- weights
    # Every tensor the runner owns is made, and used, in inference mode: a compiled decode step
    # (guarded on how its inputs were made) then survives `refresh` and `_alloc`.
    @torch.inference_mode()
    def refresh(self) -> None:
        """(Re)read the weights from the model; call after every weight update."""
        self.embed, self.final_norm, self.final_eps, self.lm_head = head_weights(self.model)
        self.eps = self.cfg.rms_norm_eps
        self.layers = read_layers(self.model, absorb_q=self.absorb_q, absorb_o=self.absorb_o)
        self._rope_table(max(self._rope_len, 256))

    def _rope_table(self, length: int) -> None:
        pos = torch.arange(length, device=self.device)[None]
        cos, sin = self.model.model.rotary_emb(torch.zeros(1, dtype=self.dtype, device=self.device), pos)
        c, s_ = cos[0, :, : cos.shape[-1] // 2], sin[0, :, : sin.shape[-1] // 2]
        self._cos, self._sin, self._rope_len = torch.cat([c, c], -1), torch.cat([-s_, s_], -1), length
        self._positions = torch.arange(length, device=self.device)
        _dynamic(self._cos, 0)
        _dynamic(self._sin, 0)

    # ----------------------------------------------------------------- cache
    @torch.inference_mode()
    def _alloc(self, rows: int, capacity: int) -> None:
        dev, dt, n, T = self.device, self.dtype, self.n, self._max_len
        C = [torch.zeros(rows, capacity, self.L + self.rope, dtype=dt, device=dev) for _ in self.layers]
        IK = [torch.zeros(rows, capacity, L.indexer.head_dim, dtype=dt, device=dev) if L.indexer is not None
              else None for L in self.layers]
        if self.rows_cap and n:
            for l in range(len(self.layers)):
                C[l][:n, :T] = self.C[l][:n, :T]
                if IK[l] is not None:
                    IK[l][:n, :T] = self.IK[l][:n, :T]
        for t in C + [t for t in IK if t is not None]:  # rows and capacity: dynamic in a compiled step
            _dynamic(t, 0, 1)
        self.C, self.IK = C, IK
        self.rows_cap, self.capacity = rows, capacity
        if capacity > self._rope_len:
            self._rope_table(capacity)
        self._alloc_capture(rows, capacity, n, T)

    def _move_rows(self, dst: torch.Tensor, src: torch.Tensor, T: int) -> None:
        for l in range(len(self.layers)):
            self.C[l][dst, :T] = self.C[l][src, :T]
            if self.IK[l] is not None:
                self.IK[l][dst, :T] = self.IK[l][src, :T]
        if self.capture is not None:
            self.capture.move(dst, src, T)

    # ----------------------------------------------------------------- forward
    @torch.inference_mode()
    def admit(self, prompts: list[list[int]]) -> torch.Tensor:
        """Prefill `prompts` into new rows at the end of the batch; logits of their last tokens [m, V]."""
        ids, lens = self._pad_prompts(prompts)
        m, S = ids.shape
        pos = torch.arange(S, device=self.device).expand(m, S)
        logits = self._forward(ids, pos, lens, self.n, self._positions[:S], lens - 1)
        self._admitted(lens)
        return logits

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, sample: partial | None = None) -> Any:
        """Append one token to every row of the batch; logits of the next token [n, V], or
        `sample(logits)` (a row-wise function, e.g. `RunningBatch.sampler()`; fused into the
        compiled step)."""
        if self._decode is not None:
            n, lens = self.n, self.lens
            # attend over a window of whole DECODE_WINDOW blocks: its length changes rarely (the compiled
            # graph has it as a symbol), and no step looks at more than a block past the longest row.
            # The window stays short of the whole cache (that would be a graph of its own).
            T = -(-(self._max_len + 1) // DECODE_WINDOW) * DECODE_WINDOW
            self._ensure(max(n, 2), T + 1)
            rows = (lambda t: t) if n > 1 else (lambda t: torch.cat([t, t]))
            if n == 1:  # one row would get a graph of its own: decode a scratch row (a free one) beside it
                tokens, lens = F.pad(tokens, (0, 1)), F.pad(lens, (0, 1))
            sample = None if sample is None else _map_tensors(sample, lambda t: _dynamic(rows(t), 0))
            out = self._decode(_dynamic(tokens, 0), _dynamic(lens, 0), _dynamic(self._positions[:T], 0), sample)
            out = out[:n] if sample is None else tuple(o[:n] for o in out)
        else:
            self._ensure(self.n, self._max_len + 1)
            out = self._forward(tokens[:, None], self.lens[:, None], self.lens + 1, 0,
                                self._positions[: self._max_len + 1], None)
            out = out if sample is None else sample(out)
        self.lens = self.lens + 1
        self._max_len += 1
        return out

    def _decode_window(self, tokens: torch.Tensor, lens: torch.Tensor, keys: torch.Tensor,
                       sample: partial | None) -> Any:
        """A decode step over cache positions `keys` = [0, T), T >= max_len + 1 (masked past each row's
        length): the same function as over [0, max_len + 1)."""
        logits = self._forward(tokens[:, None], lens[:, None], lens + 1, 0, keys, None)
        return logits if sample is None else sample(logits)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, total: torch.Tensor, r0: int, keys: torch.Tensor,
                 last: torch.Tensor | None) -> torch.Tensor:
        """ids/pos [B, S] for cache rows r0..r0+B-1; `total` [B] valid tokens per row after this
        call; attention runs over the cache positions `keys` = [0, T). `last` [B] picks one position
        per row (None: the only one)."""
        B, S = ids.shape
        H, L, r = self.H, self.L, self.rope
        cos, sin = self._cos[pos][:, :, None], self._sin[pos][:, :, None]  # [B, S, 1, r]
        T = keys.shape[0]
        mask = (keys <= pos[..., None]) & (keys < total[:, None, None])  # [B, S, T]
        row_start = torch.arange(r0, r0 + B, device=self.device)[:, None] * self.C[0].shape[1]  # rows' offsets
        flat = (row_start + pos).view(-1)  # flat cache index of every new token
        rows = slice(r0, r0 + B)
        h = F.embedding(ids, self.embed)
        selected = None
        for l, Ly in enumerate(self.layers):
            x = _rms(h, Ly.in_norm, self.eps)
            parts = F.linear(x, Ly.w_in, Ly.b_in).split(Ly.split_in, dim=-1)
            q_resid = _rms(parts[0], Ly.q_norm, Ly.q_eps)
            qb = F.linear(q_resid, Ly.w_qb).split(Ly.split_qb, dim=-1)
            latent = _rms(parts[1], Ly.kv_norm, Ly.kv_eps)
            if Ly.indexer is None:
                q_nope, q_rot = qb
                k_rot = _rope(parts[2][:, :, None], cos, sin)[:, :, 0]
            else:
                ix = Ly.indexer
                q_nope, iq_pass, q_rot = qb[0], qb[1], torch.cat([qb[2], qb[3]], -1)
                ik = F.layer_norm(parts[3], (ix.head_dim,), *Ly.k_ln)
                k2 = _rope(torch.stack([parts[2], ik[..., :r]], dim=2), cos, sin)  # [B, S, 2, r]
                k_rot, ik = k2[:, :, 0], torch.cat([k2[:, :, 1], ik[..., r:]], dim=-1)
                self.IK[l].view(-1, ix.head_dim).index_copy_(0, flat, ik.reshape(-1, ix.head_dim))
            rot = _rope(q_rot.view(B, S, -1, r), cos, sin)  # [B, S, H (+Hi), r]
            Cl = self.C[l]
            Cl.view(-1, L + r).index_copy_(0, flat, torch.cat([latent, k_rot], dim=-1).view(-1, L + r))
            if Ly.indexer is not None:
                selected = self._select(l, Ly, parts[4], rot[:, :, H:], iq_pass, mask, rows, keys)
                if self.capture is not None:
                    self._record_index(l, flat, selected)
            # attention in the latent space: q·k = (W_uk^T q_nope)·latent + q_rot·k_rot
            q_lat = q_nope.view(B * S, H, L) if Ly.w_uk is None else \
                torch.matmul(q_nope.view(B * S, H, -1).transpose(0, 1), Ly.w_uk).transpose(0, 1)  # [BS, H, L]
            q = torch.cat([q_lat, rot[:, :, :H].reshape(B * S, H, r)], dim=-1).view(B, S * H, L + r)
            cache = Cl[rows, :T]
            if selected is not None and selected.dtype == torch.long:  # decode: only the k selected keys
                at = (selected[:, 0] + row_start).view(-1)
                cache = Cl.view(-1, L + r).index_select(0, at).view(B, -1, L + r)  # [B, k, L + r]
                keep = (selected <= pos[..., None])  # [B, 1, k]: selected keys the row really has
            else:
                keep = mask if selected is None else mask & selected
            n = cache.shape[1]
            att = torch.matmul(q, cache.transpose(1, 2)).mul_(Ly.scaling).view(B, S, H, n)
            att = att.masked_fill_(~keep[:, :, None], float("-inf")).softmax(-1, dtype=torch.float32).to(h.dtype)
            o = torch.matmul(att.view(B, S * H, n), cache[..., :L])  # [B, SH, L]
            if Ly.w_uv is not None:
                o = torch.matmul(o.view(B * S, H, L).transpose(0, 1), Ly.w_uv).transpose(0, 1)  # [BS, H, dv]
            h = h + F.linear(o.reshape(B, S, -1), Ly.o_proj, Ly.o_bias)
            h = h + self._mlp(Ly, _rms(h, Ly.post_norm, self.eps), l, flat)
        h = h[:, 0] if last is None else h[torch.arange(B, device=self.device), last]
        return F.linear(_rms(h, self.final_norm, self.final_eps), self.lm_head)

    def _select(self, l: int, Ly: Layer, head_w: torch.Tensor, q_rot: torch.Tensor, q_pass: torch.Tensor,
                mask: torch.Tensor, rows: slice, positions: torch.Tensor) -> torch.Tensor | None:
        """The DSA indexer's top-k selection: key positions [B, 1, k] (long) when a decode step
        attends sparsely, else a mask [B, S, T] (None: T <= k, every key is selected).
        `positions` = arange(T)."""
        T = positions.shape[0]
        if T <= self.topk:
            return None
        ix = Ly.indexer
        B, S = mask.shape[:2]
        q = torch.cat([q_rot, q_pass.view(B, S, ix.n_heads, -1)], dim=-1)  # [B, S, Hi, Di]
        keys = self.IK[l][rows, :T]
        scores = torch.matmul(q.float().view(B, S * ix.n_heads, -1), keys.float().transpose(1, 2))
        scores = F.relu(scores.mul_(ix.softmax_scale)).view(B, S, ix.n_heads, T)
        w = head_w.float() * (ix.n_heads ** -0.5)  # weights_proj(x), from the fused input projection
        index = (w.unsqueeze(-1) * scores).sum(-2).masked_fill_(~mask, float("-inf"))  # Σ_heads w·relu(q·k)
        if S == 1:  # decode: gather the k selected keys (cheaper than a mask over all T from T = k + 1 on)
            return topk_recent(index, self.topk, positions)
        return topk_mask(index, self.topk)

    def _mlp(self, Ly: Layer, x: torch.Tensor, l: int = -1, flat: torch.Tensor | None = None) -> torch.Tensor:
        if not Ly.moe:
            g, u = F.linear(x, Ly.gate_up).chunk(2, dim=-1)
            return F.linear(F.silu(g) * u, Ly.down)
        if self.capture is None or self.capture.experts is None:
            return moe_forward(Ly.mlp, Ly.experts, x)
        y, idx = moe_forward_routed(Ly.mlp, Ly.experts, x)
        self.capture.experts.write(self._moe_slot[l], flat, idx)
        return y

    # ----------------------------------------------------------------- replay capture
    def set_capture(self, routing: bool, index: bool) -> None:
        """Record (routing) the expert ids of every MoE layer and/or (index) the DSA selection of every
        layer with its own indexer, for every token run from now on (rows already running have gaps)."""
        moe = [l for l, Ly in enumerate(self.layers) if Ly.moe]
        ix = [l for l, Ly in enumerate(self.layers) if Ly.indexer is not None]
        self._moe_slot, self._ix_slot = {l: j for j, l in enumerate(moe)}, {l: j for j, l in enumerate(ix)}
        cfg = self.cfg
        self.capture = None if not (routing or index) else Capture(
            self.device, moe_layers=len(moe), experts_per_tok=cfg.num_experts_per_tok,
            num_experts=cfg.n_routed_experts, indexer_layers=len(ix), index_topk=self.topk, routing=routing,
            index=index)
        self._alloc_capture(self.rows_cap, self.capacity, 0, 0)

    def _record_index(self, l: int, flat: torch.Tensor, selected: torch.Tensor | None) -> None:
        """The DSA selection of layer l for the tokens at `flat`: key positions [B, 1, k] (decode), or
        the first k keys of a mask [B, S, T] (prefill: exactly k for the queries at positions >= k,
        the only ones read back). None: no query has more than k keys."""
        rec = self.capture.index
        if rec is None or selected is None:
            return
        keys = selected[:, 0] if selected.dtype == torch.long else \
            (~selected).to(torch.uint8).argsort(dim=-1, stable=True)[..., : self.topk]
        rec.write(self._ix_slot[l], flat, keys)
