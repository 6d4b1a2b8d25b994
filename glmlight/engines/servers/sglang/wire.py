"""SGLang's wire formats: the request ids of attempts, output and input log-prob entries, the
sampling set-ups whose log-probs SGLang can report, and tensors for /update_weights_from_tensor: base64(ForkingPickler(list of (name, tensor))),
what SGLang's `MultiprocessingSerializer.serialize` writes and its `SafeUnpickler` reads
(sglang 0.5.23 srt/utils/common.py); every global such a pickle names is on that allow-list.

- CPU tensors: a copy is moved to a named shared-memory segment (torch's "file_system" sharing
  strategy, `rebuild_storage_filename`), which any process on the same host can open. torch's
  default strategy ("file_descriptor") sends a `multiprocessing.resource_sharer.DupFd`, which a
  separately started server cannot use: fetching the descriptor authenticates with the sender's
  multiprocessing authkey. The segment lives as long as the returned keep-alive object: hold it
  until the server has answered.
- CUDA tensors: CUDA IPC handles whose device (argument 6 of `rebuild_cuda_tensor`) is the
  device's UUID, as SGLang's `monkey_patch_torch_reductions` (srt/utils/patch_torch.py) writes and
  reads it, so the server maps it to its own device index whatever CUDA_VISIBLE_DEVICES it has.
"""

from __future__ import annotations

import base64
import io
import logging
import threading
from typing import Any

import torch

from glmlight.errors import ConfigError, EngineError
from glmlight.engines.base import Generation

log = logging.getLogger(__name__)
_DEVICE_ARG = 6  # rebuild_cuda_tensor(tensor_cls, size, stride, offset, storage_cls, dtype, device, ...)
_strategy_lock = threading.Lock()


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> tuple[str, Any]:
    """(base64 payload, keep-alive) for one TP rank; see the module docstring."""
    import torch.multiprocessing as tmp
    from multiprocessing.reduction import ForkingPickler

    staged = [(n, t.detach().clone() if t.device.type == "cpu" else t.detach()) for n, t in named]
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table = {**ForkingPickler._extra_reducers, **pickler.dispatch_table}  # type: ignore[attr-defined]
    reduce_tensor = tmp.reductions.reduce_tensor

    def reduce_with_uuid(t: torch.Tensor) -> Any:
        fn, args = reduce_tensor(t)
        if t.is_cuda and isinstance(args[_DEVICE_ARG], int):
            args = (*args[:_DEVICE_ARG], str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid),
                    *args[_DEVICE_ARG + 1:])
        return fn, args

    for cls in (torch.Tensor, torch.nn.parameter.Parameter):
        pickler.dispatch_table[cls] = reduce_with_uuid
    with _strategy_lock:
        before = tmp.get_sharing_strategy()
        tmp.set_sharing_strategy("file_system")
        try:
            pickler.dump(staged)
        finally:
            tmp.set_sharing_strategy(before)
    return base64.b64encode(buf.getvalue()).decode("ascii"), staged


FINISH_REASONS = ("stop", "length", "abort")


class FilteredLogprobsMissing(EngineError):
    """Top-k/top-p sampling on a server that cannot report the log-probs of it: the run stops."""

    fatal = True

SAMPLING_MASK_MAX_TOKENS = 4096  # SGLang's default --sampling-mask-max-tokens


def check_sampling(top_p: float, top_k: int) -> None:
    """Refuse a sampling set-up SGLang cannot report log-probs for (see the module docstring)."""
    if top_p < 1 and top_k <= 0:
        raise ConfigError("config error: rollout=sglang with rollout.top_p < 1 needs a finite rollout.top_k: SGLang "
                          "reports log-probs over the top-k/top-p support (return_sampling_mask) only with "
                          f"1 <= top_k <= --sampling-mask-max-tokens (default {SAMPLING_MASK_MAX_TOKENS})")
    if top_k > SAMPLING_MASK_MAX_TOKENS:
        log.warning("rollout.top_k=%d: SGLang refuses return_sampling_mask above --sampling-mask-max-tokens (%d by "
                    "default); start the server with a larger value", top_k, SAMPLING_MASK_MAX_TOKENS)


def attempt_rid(rid: str):
    """The request id of each attempt: fixed length, so none is a prefix of another (SGLang's
    /abort_request matches by prefix)."""
    return lambda attempt: f"{rid}-{attempt:02d}"


def single(body: Any) -> Any:
    return body[0] if isinstance(body, list) and len(body) == 1 else body


def pairs(entries: list, url: str, path: str, field: str) -> tuple[list[int], list[float]]:
    ids, lps = [], []
    for e in entries:
        if not (isinstance(e, (list, tuple)) and len(e) >= 2 and isinstance(e[1], int)
                and isinstance(e[0], (int, float)) and not isinstance(e[0], bool)):
            raise EngineError(f"SGLang server at {url} answered {path} with a malformed {field} entry {str(e)[:60]}")
        ids.append(e[1])
        lps.append(float(e[0]))
    return ids, lps


def parse_generate_answer(body: Any, url: str, rid: str, filtered: bool,
                          name: str = "SGLang") -> tuple[Generation, dict, list[str]]:
    """(generation without versions, meta_info, weight-version labels) of a /generate answer to `rid`;
    `filtered`: the log-probs are meta_info.output_token_sampling_logprobs (top-k/top-p renormalised).
    A body of another shape is one EngineError naming the field."""
    from glmlight.engines.servers.http import get_field

    path = "/generate"
    meta = get_field(body, "meta_info", url, path, name, dict)
    if not str(meta.get("id", rid)).startswith(rid):
        raise EngineError(f"SGLang server at {url} answered request {rid} with meta_info.id {meta['id']!r}")
    ids, lps = pairs(get_field(body, "meta_info.output_token_logprobs", url, path, name, list), url, path,
                     "meta_info.output_token_logprobs")
    out_ids = body.get("output_ids")
    if out_ids is not None and list(out_ids) != ids:
        raise EngineError(f"SGLang server at {url} answered {path} with output_ids that differ from "
                          "meta_info.output_token_logprobs")
    fin = get_field(body, "meta_info.finish_reason", url, path, name, (dict, str))
    kind = fin.get("type") if isinstance(fin, dict) else fin
    if kind not in FINISH_REASONS:
        raise EngineError(f"SGLang server at {url} answered {path} with unknown meta_info.finish_reason {kind!r}")
    if filtered and ids:
        field = "meta_info.output_token_sampling_logprobs"
        lps = get_field(body, field, url, path, name, list)
        if len(lps) != len(ids) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in lps):
            raise EngineError(f"SGLang server at {url} answered {path} with {len(lps)} {field} for {len(ids)} "
                              "tokens (top-k/top-p log-probs need SGLang 0.5.18 or later)")
        lps = [float(x) for x in lps]
    spans = meta.get("weight_versions")
    labels = ([str(s.get("version")) for s in spans if isinstance(s, dict)] if isinstance(spans, list) and spans
              else ([str(meta["weight_version"])] if meta.get("weight_version") is not None else []))
    return Generation(token_ids=ids, logprobs=lps, finish_reason=kind, versions=[]), meta, labels
