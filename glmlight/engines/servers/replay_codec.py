"""Replay records from SGLang's and vLLM's answers: pure decoders to `Sample.routed_experts` and
`Sample.indexer_topk` (the embedded engine's capture layout, `glmlight/sample.py`).

Every decoder takes the base64 string the server sent, `num_tokens` = len(prompt ids) + len(output
ids) of the request, and the model's `RecordLayout`; it returns the record (each row ascending, the
compact dtype) or raises `ReplayDecodeError` with one line. The payload formats, from the sources
(paths inside the sglang-0.5.23 and vllm-0.33.0 wheels):

SGLang `/generate`, `meta_info.routed_experts` (request `return_routed_experts: true`,
`routed_experts_start_len`, server `--enable-return-routed-experts`):
  base64 of the raw C-order bytes of an int32 array (`srt/managers/detokenizer_manager.py:431-447`,
  `srt/managers/tokenizer_manager.py:2602-2608`; decoded with `np.frombuffer(.., np.int32)`,
  `srt/state_capturer/routed_experts.py:166-174`), shape [num_tokens - 1 - start_len,
  num_hidden_layers, num_experts_per_tok] (`srt/managers/scheduler_components/batch_result_processor.py:136-179`,
  `srt/state_capturer/base.py:173-188`): row j = the token at position start_len + j as an input;
  dense layers are never written and hold 0 (`base.py:38-42, 63-75`); logical expert ids (captured
  before expert-location dispatch, `srt/layers/moe/topk.py:2548-2574`).
SGLang `meta_info.indexer_topk` (request `return_indexer_topk: true`, server
`--enable-return-indexer-topk`, CUDA/NPU only): int32, shape [num_tokens - 1, num_indexer_layers,
  index_topk] from position 0 (`batch_result_processor.py:181-189`); for GLM-5 num_indexer_layers =
  num_hidden_layers, layers that share the previous selection mirrored (`srt/configs/model_config.py:548-563`).
  The values are positions in the request, -1 padded, only with the unfused top-k
  (`srt/layers/attention/dsa/dsa_topk_backend.py:109-110, 272-309`), i.e. a server started with
  SGLANG_DSA_FUSE_TOPK=0; by default (`srt/environ.py:1978`) the fused transform writes KV-cache
  slot ids (`dsa_topk_backend.py:23-27`), which no client can map back. A value beyond its query's
  position shows that, and is rejected.
vLLM `/v1/completions`, `choices[i].routed_experts` (server `--enable-return-routed-experts`, request
`routed_experts_prompt_start`): base64 of `.npy` bytes (`np.save(.., allow_pickle=False)`,
  `vllm/utils/serial_utils.py:67-71`, `vllm/entrypoints/openai/completion/serving.py:630-653`), uint8
  when num_experts <= 256 else uint16 (`vllm/model_executor/layers/fused_moe/routed_experts_capturer.py:66-70`;
  the protocol comment also names int32, `completion/protocol.py:685-699`), shape
  [num_tokens - 1 - routed_experts_prompt_start, num_hidden_layers, num_experts_per_tok] (capturer 31-42).

Replay needs records from position 0: ask with start_len / prompt_start 0 (the default).

The `*_payload` functions go the other way: what those servers send for given records (for stand-ins
of the servers that are backed by the embedded engine).
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from glmlight.models.glm5.replay import indexer_layers, moe_layers, routing_shape
from glmlight.sample import expert_dtype, position_dtype


class ReplayDecodeError(ValueError):
    """A server's replay payload that cannot be read as records of this request and model."""


@dataclass(frozen=True)
class RecordLayout:
    """Where the records of a model sit in a server's per-layer arrays."""

    num_hidden_layers: int
    moe_layers: tuple[int, ...]  # decoder layers with a routed MoE (the layer axis of routing records)
    experts_per_tok: int
    num_experts: int
    indexer_layers: tuple[int, ...] = ()  # decoder layers with their own DSA indexer
    index_topk: int = 0

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> "RecordLayout":
        """The layout of a loaded model (what glmlight's trainer replays into)."""
        cfg = model.config
        r = routing_shape(model) or (0, 0, 0)
        ix = indexer_layers(model)
        return cls(cfg.num_hidden_layers, tuple(moe_layers(model)), r[1], r[2], tuple(ix),
                   int(getattr(cfg, "index_topk", 0)) if ix else 0)

    @classmethod
    def from_glm5_config(cls, cfg: Any) -> "RecordLayout":
        """The layout of a GlmMoeDsaConfig (transformers): MoE where mlp_layer_types is "sparse", own
        indexer where indexer_types is "full"."""
        return cls(cfg.num_hidden_layers, tuple(i for i, t in enumerate(cfg.mlp_layer_types) if t == "sparse"),
                   cfg.num_experts_per_tok, cfg.n_routed_experts,
                   tuple(i for i, t in enumerate(cfg.indexer_types) if t == "full"), cfg.index_topk)


def decode_sglang_routed_experts(payload: str, num_tokens: int, layout: RecordLayout,
                                 start_len: int = 0) -> torch.Tensor:
    """SGLang's `meta_info.routed_experts` -> `Sample.routed_experts` [num_tokens - 1, MoE layers, k]."""
    flat = np.frombuffer(_b64(payload, "routed_experts"), dtype=np.int32)
    return _experts(flat, num_tokens, layout, start_len, "SGLang routed_experts", "routed_experts_start_len")


def decode_vllm_routed_experts(payload: str, num_tokens: int, layout: RecordLayout,
                               prompt_start: int = 0) -> torch.Tensor:
    """vLLM's `choices[i].routed_experts` -> `Sample.routed_experts` [num_tokens - 1, MoE layers, k]."""
    try:
        arr = np.load(io.BytesIO(_b64(payload, "routed_experts")), allow_pickle=False)
    except ValueError as e:
        raise ReplayDecodeError(f"vLLM routed_experts is not a .npy array ({e})") from None
    if arr.dtype not in (np.uint8, np.uint16, np.int32):
        raise ReplayDecodeError(f"vLLM routed_experts has dtype {arr.dtype}; expected uint8, uint16 or int32")
    want = (num_tokens - 1 - prompt_start, layout.num_hidden_layers, layout.experts_per_tok)
    if arr.shape != want:
        raise ReplayDecodeError(f"vLLM routed_experts has shape {arr.shape}; expected {want} "
                                f"(num_tokens - 1 - routed_experts_prompt_start, layers, experts per token)")
    return routed_experts_from_vllm_array(arr, num_tokens, layout, prompt_start)


def routed_experts_from_vllm_array(arr: np.ndarray, num_tokens: int, layout: RecordLayout,
                                   prompt_start: int = 0) -> torch.Tensor:
    """vLLM's `RequestOutput` routed experts as the array itself (`vllm.LLM` in this process) ->
    `Sample.routed_experts`."""
    want = (num_tokens - 1 - prompt_start, layout.num_hidden_layers, layout.experts_per_tok)
    if tuple(arr.shape) != want:
        raise ReplayDecodeError(f"vLLM routed_experts has shape {tuple(arr.shape)}; expected {want} "
                                f"(num_tokens - 1 - routed_experts_prompt_start, layers, experts per token)")
    return _experts(np.asarray(arr).astype(np.int64).reshape(-1), num_tokens, layout, prompt_start,
                    "vLLM routed_experts", "routed_experts_prompt_start")


def decode_sglang_indexer_topk(payload: str, num_tokens: int, layout: RecordLayout) -> torch.Tensor:
    """SGLang's `meta_info.indexer_topk` -> `Sample.indexer_topk` [max(0, num_tokens - 1 - k), indexer
    layers, k] (the queries at positions k.., ascending)."""
    k, n = layout.index_topk, num_tokens - 1
    if not layout.indexer_layers or k <= 0:
        raise ReplayDecodeError("indexer_topk: the model has no DSA indexer")
    flat = np.frombuffer(_b64(payload, "indexer_topk"), dtype=np.int32)
    per_row = layout.num_hidden_layers * k
    if n < 0 or flat.size != n * per_row:
        raise ReplayDecodeError(f"SGLang indexer_topk holds {flat.size} int32 values; expected {max(n, 0)} x "
                                f"{layout.num_hidden_layers} x {k} for {num_tokens} tokens")
    rows = torch.from_numpy(flat.reshape(n, layout.num_hidden_layers, k)[k:, list(layout.indexer_layers)].copy())
    out = rows.sort(dim=-1).values
    if len(out):
        query = torch.arange(k, n)[:, None, None]
        if bool((out < 0).any()):
            raise ReplayDecodeError("SGLang indexer_topk: a query with more than index_topk keys has a -1 entry")
        if bool((out > query).any()):
            raise ReplayDecodeError("SGLang indexer_topk holds values beyond their query's position: KV-cache slot "
                                    "ids, not positions (start the server with SGLANG_DSA_FUSE_TOPK=0)")
        if bool((out[..., 1:] == out[..., :-1]).any()):
            raise ReplayDecodeError("SGLang indexer_topk: a query selects the same key twice")
    return out.to(position_dtype(max(n, 1)))


def sglang_routed_experts_payload(record: torch.Tensor, layout: RecordLayout) -> str:
    """What SGLang sends as `meta_info.routed_experts` for `Sample.routed_experts` record (every layer,
    dense ones 0, int32 bytes, base64)."""
    return _b64_encode(_all_layers(record, layout, layout.moe_layers, fill=0))


def vllm_routed_experts_payload(record: torch.Tensor, layout: RecordLayout) -> str:
    """What vLLM sends as `choices[i].routed_experts` for a record (every layer, uint8/uint16 .npy, base64)."""
    arr = _all_layers(record, layout, layout.moe_layers, fill=0).astype(np.uint8 if layout.num_experts <= 256
                                                                        else np.uint16)
    with io.BytesIO() as buffer:
        np.save(buffer, arr, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def sglang_indexer_topk_payload(record: torch.Tensor, num_tokens: int, layout: RecordLayout) -> str:
    """What SGLang (unfused top-k) sends as `meta_info.indexer_topk` for a `Sample.indexer_topk` record:
    [num_tokens - 1, every layer, k] int32, a query before position k selecting its keys 0..p then -1,
    a layer without its own indexer the previous one's selection."""
    n, k = num_tokens - 1, layout.index_topk
    out = np.full((n, layout.num_hidden_layers, k), -1, dtype=np.int32)
    for p in range(min(n, k)):
        out[p, :, : p + 1] = np.arange(p + 1)
    rec, last = record.numpy().astype(np.int32), None
    for layer in range(layout.num_hidden_layers):
        if layer in layout.indexer_layers:
            last = layout.indexer_layers.index(layer)
        if last is not None and n > k:
            out[k:, layer] = rec[:, last]
    return _b64_encode(out)


def _all_layers(record: torch.Tensor, layout: RecordLayout, layers: tuple[int, ...], fill: int) -> np.ndarray:
    out = np.full((record.shape[0], layout.num_hidden_layers, record.shape[2]), fill, dtype=np.int32)
    out[:, list(layers)] = record.numpy().astype(np.int32)
    return out


def _b64_encode(arr: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(arr, dtype=np.int32).tobytes()).decode("utf-8")


def _experts(flat: np.ndarray, num_tokens: int, layout: RecordLayout, start: int, what: str,
             option: str) -> torch.Tensor:
    if start != 0:
        raise ReplayDecodeError(f"{what}: replay needs the records from position 0; send {option}=0 (got {start})")
    n, L, k = num_tokens - 1, layout.num_hidden_layers, layout.experts_per_tok
    if n < 0 or flat.size != n * L * k:
        raise ReplayDecodeError(f"{what} holds {flat.size} values; expected {max(n, 0)} x {L} x {k} for "
                                f"{num_tokens} tokens")
    rows = torch.from_numpy(flat.reshape(n, L, k)[:, list(layout.moe_layers)].astype(np.int64))
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= layout.num_experts):
        raise ReplayDecodeError(f"{what} holds an expert id outside [0, {layout.num_experts})")
    return rows.sort(dim=-1).values.to(expert_dtype(layout.num_experts))


def _b64(payload: Any, what: str) -> bytes:
    if not isinstance(payload, str):
        raise ReplayDecodeError(f"{what} is {type(payload).__name__}, expected a base64 string")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ReplayDecodeError(f"{what} is not valid base64 ({e})") from None
