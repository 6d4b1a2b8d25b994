"""Continuous batching for any transformers causal LM, through its own forward and DynamicCache.

The running batch is one left-padded `DynamicCache`: every row's tokens end at
the same (last) cache position, so one decode step appends one column for all
rows. Newcomers are prefilled in their own cache (left-padded among themselves)
and merged in: both caches are left-padded to a common length per layer — keys,
values and, for DSA models (`DynamicIndexedLayer`), the indexer keys — and
concatenated along the batch; the attention mask carries the padding. Rows that
finish are dropped with `batch_select_indices`, and columns that became padding
for every remaining row are cut from the left.

Exactness: a row's positions (`position_ids`) and visible tokens are the same
whatever it is batched with; only the number of masked columns changes, which
moves fp32 results in their last bits. (DSA models: when index scores tie at the
top-k cut-off, transformers' top-k may pick different tied tokens for different
padding; the GLM-5 runner in `glm_runner.py` does not have that dependence.)

Replay capture (`set_capture`, `records`): forward hooks on the model's routers and DSA indexers
(`glmlight/models/glm5/replay.py`) hand each forward's choices to per-row, per-position records
(`glmlight/engines/local/records.py`); the indexer's cache columns become sequence positions.

FP8-held weights (`glmlight.models.fp8`) are dequantised once per forward (`parametrize.cached`),
not once per read (MoE experts read theirs once per selected expert).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer

from glmlight.models.glm5.replay import (decoder_layers, index_shape, indexer_layers, indexer_of, moe_layers, router_of,
                                         routing_shape)
from glmlight.engines.local.records import Capture


class HFRunner:
    """Per-request prefill and merged decoding with the model's own forward."""

    def __init__(self, model: PreTrainedModel, pad_token_id: int = 0):
        self.model = model
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # [n, T]
        self.next_pos = torch.zeros(0, dtype=torch.long, device=self.device)  # [n]
        self.n = 0
        self.capture: Capture | None = None  # replay records (set_capture)
        self._seen: dict[tuple[str, int], torch.Tensor] = {}  # the choices of the last forward, by the hooks
        self._hooks: list = []

    @property
    def can_merge(self) -> bool:
        """Whether newcomers can join a running batch (every cache layer is a kind we can pad)."""
        return self.cache is None or all(_mergeable(layer) for layer in self.cache.layers)

    def refresh(self) -> None:
        """Weights are read from the model at every call; nothing to rebuild."""

    def reset(self) -> None:
        self.cache, self.n = None, 0
        self.mask, self.next_pos = self.mask[:0, :0], self.next_pos[:0]

    @torch.inference_mode()
    def admit(self, prompts: list[list[int]]) -> torch.Tensor:
        """Prefill `prompts` and append them to the batch; logits of their last tokens [m, V]."""
        m, P = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((m, P), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((m, P), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, P - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        with parametrize.cached():
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                                logits_to_keep=1).logits[:, -1]
        if self.capture is not None:
            real = mask.bool()
            rows = (self.n + torch.arange(m, device=self.device))[:, None].expand(m, P)
            self._record(rows[real], pos[real], real, P - real.sum(1, keepdim=True))
        if self.cache is None or self.n == 0:
            self.cache, self.mask, self.next_pos = cache, mask, pos[:, -1] + 1
        else:
            self._merge(cache, mask, pos[:, -1] + 1)
        self.n += m
        return logits

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, sample: Callable[[torch.Tensor], Any] | None = None) -> Any:
        """Append one token to every row; logits of the next token [n, V], or `sample(logits)`."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.n, 1)], dim=1)
        with parametrize.cached():
            logits = self.model(input_ids=tokens[:, None], attention_mask=self.mask,
                                position_ids=self.next_pos[:, None], cache=self.cache, use_cache=True).logits[:, -1]
        if self.capture is not None:
            rows = torch.arange(self.n, device=self.device)
            self._record(rows, self.next_pos, self.mask.new_ones(self.n, 1, dtype=torch.bool),
                         self.mask.shape[1] - 1 - self.next_pos[:, None])
        self.next_pos = self.next_pos + 1
        return logits if sample is None else sample(logits)

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (indices into the running batch, in this order)."""
        if len(rows) == 0:
            self.reset()
            return
        rows = torch.tensor(rows, device=self.device)
        if self.capture is not None:
            self.capture.move(torch.arange(len(rows), device=self.device), rows, self.capture.parts[0].capacity)
        self.cache.batch_select_indices(rows)
        self.mask, self.next_pos, self.n = self.mask[rows], self.next_pos[rows], len(rows)
        lead = int(self.mask.any(0).long().argmax())  # columns that are padding for every row
        if lead and self.can_merge:
            self.mask = self.mask[:, lead:]
            for layer in self.cache.layers:
                _crop_left(layer, lead)

    def _merge(self, cache: DynamicCache, mask: torch.Tensor, next_pos: torch.Tensor) -> None:
        T_old, T_new = self.mask.shape[1], mask.shape[1]
        T = max(T_old, T_new)
        for old, new in zip(self.cache.layers, cache.layers):
            _merge_layer(old, new, T - T_old, T - T_new)
        self.mask = torch.cat([F.pad(self.mask, (T - T_old, 0)), F.pad(mask, (T - T_new, 0))])
        self.next_pos = torch.cat([self.next_pos, next_pos])


    # ----------------------------------------------------------------- replay capture
    def set_capture(self, routing: bool, index: bool) -> None:
        """Record (routing) the expert ids of every MoE layer and/or (index) the DSA selection of every
        layer with its own indexer, for every token run from now on (rows already running have gaps)."""
        for h in self._hooks:
            h.remove()
        self._hooks, self.capture = [], None
        r, ix = routing_shape(self.model) if routing else None, index_shape(self.model) if index else None
        if r is None and ix is None:
            return
        self.capture = Capture(self.device, moe_layers=r[0] if r else 0, experts_per_tok=r[1] if r else 1,
                               num_experts=r[2] if r else 1, indexer_layers=ix[0] if ix else 0,
                               index_topk=ix[1] if ix else 1, routing=r is not None, index=ix is not None)
        self.capture.alloc(max(self.n, 8), 128)
        layers = decoder_layers(self.model)
        for kind, ids, module_of in (("experts", moe_layers(self.model) if r else [], router_of),
                                     ("index", indexer_layers(self.model) if ix else [], indexer_of)):
            for j, i in enumerate(ids):
                def hook(mod, args, out, key=(kind, j)):
                    self._seen[key] = (out[2] if key[0] == "experts" else out).detach()
                self._hooks.append(module_of(layers[i]).register_forward_hook(hook))

    def records(self, row: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The replay records of `row`, for the positions it ran (`Capture.read`)."""
        return (None, None) if self.capture is None else self.capture.read(row, int(self.next_pos[row]))

    def _record(self, rows: torch.Tensor, positions: torch.Tensor, real: torch.Tensor, offsets: torch.Tensor) -> None:
        """Write the last forward's choices: the real tokens `real` [B, S] of its input are (rows,
        positions) [N]; a key column c of a row is position c - offsets[row] ([B, 1])."""
        cap, seen = self.capture, self._seen
        need_rows, need_len = int(rows.max()) + 1, int(positions.max()) + 1
        first = cap.parts[0]
        if need_rows > first.rows or need_len > first.capacity:
            cap.alloc(max(need_rows, 2 * first.rows), max(need_len, 2 * first.capacity), first.rows, first.capacity)
        B, S = real.shape
        if cap.experts is not None:
            for j in range(cap.experts.layers):
                cap.experts.write_at(j, rows, positions, seen.pop(("experts", j)).view(B, S, -1)[real])
        if cap.index is not None:
            for j in range(cap.index.layers):
                cols = seen.pop(("index", j)).long()  # [B, S, min(k, T)]
                if cols.shape[-1] == cap.index.width:  # (fewer keys than k: no query selects; nothing read)
                    cap.index.write_at(j, rows, positions, (cols - offsets[:, :, None])[real])
        seen.clear()


def _mergeable(layer) -> bool:
    return type(layer) in (DynamicLayer, DynamicIndexedLayer) and getattr(layer, "indexer_position_ids", None) is None


def _left_pad(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return x
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def _merge_layer(old, new, pad_old: int, pad_new: int) -> None:
    """Left-pad two cache layers to one length and stack new's rows under old's (in place on old)."""
    if not getattr(old, "is_initialized", False) or not getattr(new, "is_initialized", False):
        return
    old.keys = torch.cat([_left_pad(old.keys, pad_old, -2), _left_pad(new.keys, pad_new, -2)])
    old.values = torch.cat([_left_pad(old.values, pad_old, -2), _left_pad(new.values, pad_new, -2)])
    if isinstance(old, DynamicIndexedLayer) and old.is_indexer_initialized:
        old.indexer_keys = torch.cat([_left_pad(old.indexer_keys, pad_old, 1),
                                      _left_pad(new.indexer_keys, pad_new, 1)])


def _crop_left(layer, n: int) -> None:
    if not getattr(layer, "is_initialized", False):
        return
    layer.keys, layer.values = layer.keys[..., n:, :], layer.values[..., n:, :]
    if isinstance(layer, DynamicIndexedLayer) and layer.is_indexer_initialized:
        layer.indexer_keys = layer.indexer_keys[:, n:]
