"""One forward of a prompt for all the responses that share it: the logits of a batch whose rows repeat
prompts (a GRPO group's samples) with each distinct prompt encoded once (Prefix Grouper, Liu et al. 2025,
arXiv 2506.05433, sec. 3: the shared prefix's self-attention once, each suffix attending to the prefix's
keys and values and to its own).

A row's prompt positions see only the prompt, so their hidden states, keys and values are the same in
every row that holds that prompt. This runs the model twice through its own (transformers) forward:

    1. the distinct prompts, filling a key/value cache, with the logits of their last position only
       (they predict each response's first token);
    2. every row's response (all but its last token, whose logits predict nothing trained), with the
       cache's rows selected for the rows that share them (`select_rows`).

The selection is part of the autograd graph, so the gradients of the prompt's keys and values sum over
the rows that read them, exactly as in a forward over every row: the same logits and the same gradients,
up to float reassociation. What it saves is the prompt's forward and backward for all but one row of
each group: on SmolLM2-135M-Instruct, 4 prompts of 47 tokens x 8 responses of 32, forward and backward
took 12 s instead of 30 s on one CPU thread.

Used only where it is exact and the model can do it (`plan`): a transformers causal LM that takes a
cache and `logits_to_keep`, whose layers all keep plain keys and values (a `DynamicCache` of
`DynamicLayer`s: not GLM-5's DSA index cache, sliding windows or recurrent state), without gradient
checkpointing (transformers then drops the cache), without active dropout (the copies would share one
dropout mask), not FSDP-sharded (every forward is a collective there), and without replay (its records
are laid out per row)."""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable

import torch

from glmlight.sample import Experience

log = logging.getLogger(__name__)

# model -> the keyword its forward takes a cache by, or None: it cannot share a prompt's forward
_VERDICTS: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = weakref.WeakKeyDictionary()


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under peft's wrappers (PeftModel.base_model (LoraModel).model)."""
    inner = model
    for attr in ("base_model", "model"):
        if type(inner).__name__.startswith(("Peft", "Lora")) and hasattr(inner, attr):
            inner = getattr(inner, attr)
    return inner


def cache_argument(model: torch.nn.Module) -> str | None:
    """The keyword `model`'s forward takes its key/value cache by ("cache" from transformers 5.x, earlier
    "past_key_values"), or None when the model cannot share a prompt's forward (module docstring)."""
    if model not in _VERDICTS:
        inner = inner_model(model)
        _VERDICTS[model] = _cache_argument(inner)
        log.info("trainer forward of %s: %s", type(inner).__name__,
                 "a prompt that rows repeat runs once (algo.share_prompt_forward)" if _VERDICTS[model] else
                 "a forward per row (its key/value cache is not plain keys and values, or it takes no cache)")
    return _VERDICTS[model]


def _cache_argument(inner: torch.nn.Module) -> str | None:
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    try:
        params = inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return None
    name = next((n for n in ("cache", "past_key_values") if n in params), None)
    config = getattr(inner, "config", None)
    if name is None or "logits_to_keep" not in params or config is None:
        return None
    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # noqa: BLE001 - a config transformers cannot build a cache for
        return None
    return name if layers and all(type(layer) is DynamicLayer for layer in layers) else None


def prompt_groups(exp: Experience) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(first, inverse): a row index of each distinct prompt, and each row's distinct prompt; None when
    no two rows share one. Prompts are compared with their padding and positions."""
    P, B = exp.prompt_length, exp.batch_size
    if B < 2 or P == 0:
        return None
    key = torch.cat([exp.input_ids[:, :P], exp.attention_mask[:, :P].to(exp.input_ids.dtype),
                     exp.position_ids[:, :P].to(exp.input_ids.dtype)], dim=1)
    distinct, inverse = torch.unique(key, dim=0, return_inverse=True)
    if distinct.shape[0] == B:
        return None
    rows = torch.arange(B, device=inverse.device)
    first = torch.full((distinct.shape[0],), B, dtype=torch.long, device=inverse.device)
    return first.scatter_reduce_(0, inverse, rows, reduce="amin"), inverse


def _dropout_active(model: torch.nn.Module) -> bool:
    if not model.training:
        return False
    config = getattr(inner_model(model), "config", None)
    if any(float(getattr(config, k, 0.0) or 0.0) > 0 for k in ("attention_dropout", "hidden_dropout", "dropout")):
        return True
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training for m in model.modules())


def plan(model: torch.nn.Module, exp: Experience) -> Callable[[], torch.Tensor] | None:
    """A function returning the logits [B, T, V] that predict each response token (as a forward over
    every row would), or None when sharing does not apply to this model or batch."""
    name = cache_argument(model)
    if name is None or getattr(inner_model(model), "is_gradient_checkpointing", False) and model.training:
        return None
    groups = prompt_groups(exp)
    if groups is None or _dropout_active(model):
        return None
    return lambda: forward_logits(model, exp, *groups, cache_argument=name)


def select_rows(cache, rows: torch.Tensor) -> None:
    """Each row of the cache's keys and values taken from row `rows[i]`, by `index_select`: its backward
    sums the rows' gradients with `index_add_`, one index after another. transformers' own
    `batch_select_indices` indexes (`keys[rows]`), whose backward on CPU is `index_put_(accumulate=True)`:
    two threads add into a shared prompt's row in whatever order they reach it, so the gradient's last bits
    depended on the machine's load (a group's rows split between the threads: 29 different gradients in 30
    backwards beside a busy thread; by `index_select`, 1)."""
    for layer in cache.layers:  # DynamicLayers (`plan` checks): plain keys and values [B, H, S, D]
        if layer.get_seq_length() > 0:
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)


def forward_logits(model: torch.nn.Module, exp: Experience, first: torch.Tensor, inverse: torch.Tensor,
                   cache_argument: str = "cache") -> torch.Tensor:
    """Logits [B, T, V] at columns P-1 .. P+T-2 of `exp` (those predicting the response tokens), the
    distinct prompts `exp.input_ids[first, :P]` run once (module docstring)."""
    from transformers import DynamicCache

    P, L = exp.prompt_length, exp.input_ids.shape[1]
    cache = DynamicCache(config=inner_model(model).config)
    head = model(input_ids=exp.input_ids[first, :P], attention_mask=exp.attention_mask[first, :P],
                 position_ids=exp.position_ids[first, :P], use_cache=True, logits_to_keep=1,
                 **{cache_argument: cache})
    last = head.logits.index_select(0, inverse)  # [B, 1, V]: column P-1 predicts the first response token
    if L - P <= 1:
        return last
    select_rows(cache, inverse)  # each row reads its prompt's keys and values (autograd: summed back)
    out = model(input_ids=exp.input_ids[:, P:-1], attention_mask=exp.attention_mask[:, :-1],
                position_ids=exp.position_ids[:, P:-1], use_cache=True, **{cache_argument: cache})
    return torch.cat([last, out.logits], dim=1)
