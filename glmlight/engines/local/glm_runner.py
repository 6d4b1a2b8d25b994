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

from glmlight.errors import EngineError
from glmlight.models.glm5.arch import glm4_moe_lite_unsupported, is_glm4_moe_lite, is_glm5
from glmlight.models.glm5.moe import moe_forward, moe_forward_routed
from glmlight.ops.dsa import topk_mask, topk_recent
from glmlight.ops.mtp import mtp_input
from glmlight.engines.local.glm_weights import Layer, read_layers
from glmlight.engines.local.records import Capture
from glmlight.engines.local.rows import (DECODE_WINDOW, RowCache, _dynamic, _map_tensors,
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
        # speculative decoding (`enable_speculation`): the MTP layer that drafts, its norms and projection, the
        # main model's normed last hidden state and token at every cached position, and per row how many
        # positions of the draft layer's cache hold the inputs of accepted tokens
        self.draft_layers: list[Layer] = []
        self.mtp: Any = None
        self.hidden: torch.Tensor | None = None
        self.token_ids: torch.Tensor | None = None
        self.mtp_len = torch.zeros(0, dtype=torch.long, device=self.device)
        self.catchup = 0  # positions the last draft's catch-up covered (speculation's cost rule reads it)
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
        if self.mtp is not None:
            self._read_draft()
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
        cached = self.layers + self.draft_layers
        C = [torch.zeros(rows, capacity, self.L + self.rope, dtype=dt, device=dev) for _ in cached]
        IK = [torch.zeros(rows, capacity, L.indexer.head_dim, dtype=dt, device=dev) if L.indexer is not None
              else None for L in cached]
        if self.mtp is not None:
            hidden = torch.zeros(rows, capacity, self.cfg.hidden_size, dtype=dt, device=dev)
            token_ids = torch.zeros(rows, capacity, dtype=torch.long, device=dev)
            if self.hidden is not None and self.rows_cap and n:
                hidden[:n, :T], token_ids[:n, :T] = self.hidden[:n, :T], self.token_ids[:n, :T]
            self.hidden, self.token_ids = hidden, token_ids
        if self.rows_cap and n:
            for l in range(min(len(cached), len(self.C))):
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
        if self.hidden is not None:
            self.hidden[dst, :T], self.token_ids[dst, :T] = self.hidden[src, :T], self.token_ids[src, :T]
        for l in range(len(self.C)):
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

    # ----------------------------------------------------------------- speculative decoding
    @torch.inference_mode()
    def enable_speculation(self) -> None:
        """Draft with the model's first MTP layer (`glmlight.models.mtp`): from now on every forward keeps the
        main model's normed last hidden state and token per cached position, and `draft` / `verify` / `advance`
        run speculative rounds. Raises EngineError for a model without MTP layers."""
        from glmlight.models.mtp import mtp_of

        if self.mtp is not None:
            return
        mtp = mtp_of(self.model)
        if mtp is None or not len(mtp.layers):
            raise EngineError(f"speculative decoding drafts with the model's MTP layers; this "
                              f"{type(self.model).__name__} has none (model.mtp.layers=N gives it some)")
        if self.compiled:
            raise EngineError("speculative decoding runs eagerly: it cannot be combined with compile=True")
        if self.n:
            raise EngineError("enable_speculation on a runner with running rows")
        self.mtp = mtp.layers[0]
        self._read_draft()
        self._alloc(self.rows_cap, self.capacity)

    def _read_draft(self) -> None:
        """The drafting MTP layer's decoder block as the runner's fused layer (its cache: index len(layers))."""
        self.draft_layers = read_layers(self.model, absorb_q=self.absorb_q, absorb_o=self.absorb_o, layers=[self.mtp])

    def _keep_hidden(self, ids: torch.Tensor, h: torch.Tensor, pos: torch.Tensor, r0: int) -> None:
        """The normed last hidden state (the MTP layer's input, DeepSeek-V3 sec. 2.2) and the token at every
        position a forward ran (padding included: positions past a row's length are written again later)."""
        B, S = ids.shape
        flat = ((torch.arange(r0, r0 + B, device=self.device)[:, None] * self.capacity) + pos).view(-1)
        normed = _rms(h, self.final_norm, self.final_eps)
        self.hidden.view(-1, normed.shape[-1]).index_copy_(0, flat, normed.reshape(-1, normed.shape[-1]))
        self.token_ids.view(-1).index_copy_(0, flat, ids.reshape(-1))

    def _mtp_step(self, tokens: torch.Tensor, prev: torch.Tensor, pos: torch.Tensor, total: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafting MTP layer at `pos` [n, S] over the next tokens [n, S] and the previous depth's hidden
        states prev [n, S, hidden]: (its normed output [n, S, hidden], the draft layer's own hidden state for the
        next depth). Writes the layer's cache at `pos`; `total` [n] = its valid positions after the call."""
        m = self.mtp
        x = mtp_input(F.embedding(tokens, self.embed), prev, m.enorm.weight, m.hnorm.weight, m.eh_proj.weight,
                      m.enorm.variance_epsilon)
        y = self._run(x, pos, total, 0, self._positions[: int(pos.max()) + 1], [len(self.layers)], record=False)
        return _rms(y, m.shared_head.norm.weight, m.shared_head.norm.variance_epsilon)

    @torch.inference_mode()
    def draft(self, last: torch.Tensor, k: int, sample: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft k tokens after every row's last sampled token `last` [n] (not yet cached): (drafts [n, k], the
        draft's distributions [n, k, V]). `sample(logits [n, V], j)` -> (tokens [n], probs [n, V]) draws draft
        j (0-based).

        Depth 1 at position t = len - 1 reads Emb(last) and the main model's normed hidden state at t; first the
        layer's cache catches up on the positions accepted since its last round (mtp_len..len - 1, their
        inputs Emb(x_{t+1}) and h_t from the cache's kept hidden states and tokens, in the same forward). Drafts
        2..k run the same layer on at the next positions, each fed by the draft before and the layer's own
        normed output (its hidden state) at the position before, as SGLang's and vLLM's MTP drafters chain one
        MTP layer; those positions of the layer's cache are provisional and written again by the next catch-up."""
        n, lens = self.n, self.lens
        start = self.mtp_len
        count = lens - start  # >= 1: position len - 1 at least
        S = self.catchup = int(count.max())
        self._ensure(n, max(int(start.max()) + S, self._max_len) + k + 1)
        pos = start[:, None] + torch.arange(S, device=self.device)  # [n, S]; past len - 1: padding
        rows = torch.arange(n, device=self.device)[:, None]
        nxt = (pos + 1).clamp(max=self.capacity - 1)
        tokens = torch.where(pos + 1 == lens[:, None], last[:, None], self.token_ids[rows, nxt])
        g = self._mtp_step(tokens, self.hidden[rows, pos], pos, lens)
        g = g[rows[:, 0], count - 1]  # [n, hidden] at position len - 1
        self.mtp_len = lens.clone()
        drafts, probs = [], []
        for j in range(k):
            tok, q = sample(F.linear(g, self.lm_head), j)
            drafts.append(tok)
            probs.append(q)
            if j + 1 < k:
                at = (lens + j)[:, None]
                g = self._mtp_step(tok[:, None], g[:, None], at, lens + j + 1)[:, 0]
        return torch.stack(drafts, 1), torch.stack(probs, 1)

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor) -> torch.Tensor:
        """The target's forward over tokens [n, S] (the last sampled token, then the drafts) at positions
        len..len + S - 1 of every row: logits [n, S, V]. Writes the caches and the replay records there; the
        lengths move only with `advance` (positions past it are rolled back: masked, written again later)."""
        n, S = tokens.shape
        self._ensure(n, self._max_len + S)
        pos = self.lens[:, None] + torch.arange(S, device=self.device)
        h = self._run(F.embedding(tokens, self.embed), pos, self.lens + S, 0, self._positions[: self._max_len + S],
                      range(len(self.layers)), record=True)
        self._keep_hidden(tokens, h, pos, 0)
        return F.linear(_rms(h, self.final_norm, self.final_eps), self.lm_head)

    @torch.inference_mode()
    def advance(self, counts: torch.Tensor) -> None:
        """Every row keeps `counts` [n] of the positions `verify` ran (the tokens it emitted, the last one of
        them not yet cached)."""
        self.lens = self.lens + counts
        self._max_len = int(self.lens.max()) if self.n else 0

    def _admitted(self, lens: torch.Tensor) -> None:
        super()._admitted(lens)
        if self.mtp is not None:  # new rows: the draft layer's cache catches up on their prompts in their first round
            self.mtp_len = torch.cat([self.mtp_len, torch.zeros_like(lens)])

    @torch.inference_mode()
    def keep(self, rows: list[int]) -> None:
        if self.mtp is not None:
            self.mtp_len = self.mtp_len[torch.tensor(rows, dtype=torch.long, device=self.device)]
        super().keep(rows)

    def reset(self) -> None:
        super().reset()
        self.mtp_len = self.mtp_len[:0]

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, total: torch.Tensor, r0: int, keys: torch.Tensor,
                 last: torch.Tensor | None) -> torch.Tensor:
        """ids/pos [B, S] for cache rows r0..r0+B-1; `total` [B] valid tokens per row after this
        call; attention runs over the cache positions `keys` = [0, T). `last` [B] picks one position
        per row (None: the only one)."""
        B = ids.shape[0]
        h = self._run(F.embedding(ids, self.embed), pos, total, r0, keys, range(len(self.layers)), record=True)
        if self.hidden is not None:  # speculation: the normed last hidden states and tokens, for the MTP draft
            self._keep_hidden(ids, h, pos, r0)
        h = h[:, 0] if last is None else h[torch.arange(B, device=self.device), last]
        return F.linear(_rms(h, self.final_norm, self.final_eps), self.lm_head)

    def _run(self, h: torch.Tensor, pos: torch.Tensor, total: torch.Tensor, r0: int, keys: torch.Tensor,
             layers: Any, record: bool) -> torch.Tensor:
        """The decoder layers `layers` (indices into `self.layers + self.draft_layers`, and into the caches)
        over the inputs h [B, S, hidden] at `pos` (see `_forward`); their output, before the final norm.
        `record`: write the replay records (the MTP draft's layer writes none)."""
        B, S = pos.shape
        H, L, r = self.H, self.L, self.rope
        cos, sin = self._cos[pos][:, :, None], self._sin[pos][:, :, None]  # [B, S, 1, r]
        T = keys.shape[0]
        mask = (keys <= pos[..., None]) & (keys < total[:, None, None])  # [B, S, T]
        row_start = torch.arange(r0, r0 + B, device=self.device)[:, None] * self.C[0].shape[1]  # rows' offsets
        flat = (row_start + pos).view(-1)  # flat cache index of every new token
        rows = slice(r0, r0 + B)
        selected = None
        for l in layers:
            Ly = self.layers[l] if l < len(self.layers) else self.draft_layers[l - len(self.layers)]
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
                if self.capture is not None and record:
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
            h = h + self._mlp(Ly, _rms(h, Ly.post_norm, self.eps), l, flat if record else None)
        return h

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
        if self.capture is None or self.capture.experts is None or flat is None:
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
