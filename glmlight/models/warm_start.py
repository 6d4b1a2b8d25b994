"""A short supervised warm start, cached on disk.

RL only learns when the policy sometimes succeeds; a randomly initialised tiny
model never does. The warm start trains for a few steps so that it sometimes
does: on (prompt, reference answer) pairs, or, for agent tasks, on expert
episodes (tool call, observation, final answer; summaries under compaction)
produced by the task's own agent loop, with the loss on the action tokens only
(glmlight/agents/expert.py). The result is cached keyed by everything that
determines it, so it runs once per machine.

A policy with MTP layers (model.mtp.layers, glmlight/models/mtp.py) then has them fitted on the same rows,
the main model frozen (`mtp_warm_start`, model.warm_start.mtp): each depth's cross-entropy on the trained
tokens, the loss RL keeps training them with (algo.mtp_loss_coef). Without it a fresh MTP layer drafts
nearly uniformly and speculative rollout (rollout.speculative) starts with an acceptance near 0.

The learning rate warms up linearly, then decays (cosine by default). With a
constant rate the end of the run depends on the CPU's floating-point rounding:
the same 60 arithmetic steps ended at greedy held-out pass rates of 0.469 with
AVX-512 kernels and 0.625 with AVX2 ones on one machine. Decayed, both ended at
0.891 (docs/agents.md, "Figures that hold on any machine").
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from glmlight.config.schema import WarmStartConfig
from glmlight.errors import ConfigError
from glmlight.models.mtp import mtp_of
from glmlight.prompt import Prompt, PromptSource
from glmlight.models.tokenizer import encode_chat

log = logging.getLogger(__name__)

# One training row: token ids and a loss mask (1 = this token is predicted and trained on).
Example = tuple[list[int], list[int]]
# Turns a batch of prompts into training rows.
ExampleFn = Callable[[list[Prompt]], list[Example]]


def label_examples(tokenizer: Any, answer_format: str = "{label}") -> ExampleFn:
    """(prompt, reference answer) pairs: the chat prompt, then the answer and <eos> (trained on). The answer is
    `answer_format` with "{label}" replaced by the prompt's label (task.answer_format, e.g. \\boxed{{label}})."""
    eos = tokenizer.eos_token_id

    def make(prompts: list[Prompt]) -> list[Example]:
        rows = []
        for p in prompts:
            if p.label is None:  # never teach the text "None"
                raise ConfigError("config error: model.warm_start trains on the prompts' labels, and this task's prompts "
                                  "carry none (task.label_key=null): set model.warm_start.steps=0")
            prompt = encode_chat(tokenizer, p.messages)
            text = answer_format.replace("{label}", str(p.label), 1)
            answer = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
            rows.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
        return rows

    return make


def warm_start_key(model: torch.nn.Module, cfg: WarmStartConfig, task_identity: dict[str, Any],
                   data_fingerprint: str = "") -> str:
    config = model.config.to_dict()
    config.pop("transformers_version", None)
    blob = json.dumps({"model": config, "task": task_identity, "steps": cfg.steps, "lr": cfg.lr,
                       "batch_size": cfg.batch_size, "schedule": cfg.lr_schedule, "warmup_steps": cfg.warmup_steps,
                       "min_lr_ratio": cfg.min_lr_ratio, "decay_steps": cfg.decay_steps, "data": data_fingerprint,
                       "init": _param_fingerprint(model),
                       **({"mix_batch_size": list(cfg.mix_batch_size)} if cfg.mix_batch_size else {})},
                      sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


@torch.no_grad()
def _param_fingerprint(model: torch.nn.Module) -> float:
    return float(sum(p.double().sum() for p in model.parameters()))


def _fingerprint(rows: list[Example]) -> str:
    """A digest of training rows: whatever changes the data (prompts, template, environment, expert,
    agent loop settings) changes the digest of the first batch."""
    h = hashlib.sha1()
    for ids, mask in rows:
        h.update(json.dumps([ids, mask]).encode())
    return h.hexdigest()[:16]


def lr_factor(cfg: WarmStartConfig, step: int) -> float:
    """The learning-rate multiplier of `step` (0-based): linear warm-up, then constant or cosine decay."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    start = cfg.warmup_steps if cfg.lr_schedule == "cosine" else max(cfg.warmup_steps, cfg.steps - cfg.decay_steps)
    if step < start:  # wsd: constant until the last decay_steps
        return 1.0
    progress = min(1.0, (step - start) / max(cfg.steps - start, 1))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict safetensors can write: a tensor that shares memory with one before it (tied input
    and output embeddings, e.g. SmolLM2's) is written as a copy; loading it back ties nothing new."""
    seen: set[int] = set()
    out = {}
    for k, v in state.items():
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.contiguous() if ptr not in seen else v.detach().clone().contiguous()
        seen.add(ptr)
    return out


def batch_prompts(source: PromptSource, step: int, batch_size: int) -> list[Prompt]:
    """The prompts of one warm-start step: a fixed walk through the source (the same on every machine)."""
    return [source[(step * batch_size + i) % len(source)] for i in range(batch_size)]


def _row_maker(tokenizer: Any, source: PromptSource, cfg: WarmStartConfig, examples: ExampleFn | None,
               mix: list[tuple[PromptSource, ExampleFn]]) -> tuple[Callable[[int], list[Example]], list[int]]:
    """(step -> that step's training rows, the prompts per step of each mix task)."""
    sizes = list(cfg.mix_batch_size) or [cfg.batch_size] * len(mix)  # one per mix task (`config.validate`)
    parts = [(source, examples or label_examples(tokenizer), cfg.batch_size),
             *((src, make, n) for (src, make), n in zip(mix, sizes, strict=True))]

    def make_rows(step: int) -> list[Example]:
        rows = [row for src, make, n in parts for row in make(batch_prompts(src, step, n))]
        if not rows:
            raise RuntimeError(f"warm start: step {step + 1} has no training rows (its examples gave none)")
        return rows

    return make_rows, sizes


def _fit(params: list[torch.nn.Parameter], cfg: WarmStartConfig, make_rows: Callable[[int], list[Example]],
         first: list[Example], loss_fn: Callable[[list[Example]], torch.Tensor], what: str) -> list[float]:
    """cfg.steps AdamW steps of `loss_fn` over `params` (lr cfg.lr on the warm start's schedule, gradients
    clipped to norm 1); the losses."""
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s))
    losses = []
    for step in range(cfg.steps):
        loss = loss_fn(first if step == 0 else make_rows(step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == cfg.steps - 1:
            log.info("%s step %d/%d loss %.4f", what, step + 1, cfg.steps, loss.item())
    return losses


def _save(path: str, state: dict[str, torch.Tensor], record: dict[str, Any]) -> None:
    """The cached result and, beside it, what made it (`.json`)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    save_file(unshared(state), tmp)
    os.replace(tmp, path)
    with open(path[: -len(".safetensors")] + ".json", "w") as f:
        json.dump(record, f, indent=2, default=str)


def supervised_warm_start(model: torch.nn.Module, tokenizer: Any, source: PromptSource, cfg: WarmStartConfig,
                          task_identity: dict[str, Any], examples: ExampleFn | None = None,
                          mix: list[tuple[PromptSource, ExampleFn]] = ()) -> str | None:
    """Train `model` in place for `cfg.steps` batches (or load the cached result). Returns the cache path.

    `examples` turns each step's prompts into training rows (default: `label_examples`). `mix`: more
    (source, examples) pairs, other tasks whose rows join every step's batch (`cfg.mix_batch_size[i]`
    prompts of the i-th, by default `cfg.batch_size`): one supervised pass over several formats at once."""
    if cfg.steps <= 0:
        return None
    make_rows, sizes = _row_maker(tokenizer, source, cfg, examples, mix)
    first = make_rows(0)
    key = warm_start_key(model, cfg, task_identity, _fingerprint(first))
    path = os.path.join(cfg.cache_dir, f"warm_start-{key}.safetensors")
    if os.path.exists(path):
        model.load_state_dict(load_file(path))
        model.eval()
        log.info("warm start loaded from %s", path)
        return path
    log.info("warm start: %d supervised steps (cached afterwards at %s)", cfg.steps, path)
    t0 = time.perf_counter()
    model.train()
    losses = _fit(list(model.parameters()), cfg, make_rows, first,
                  lambda rows: masked_lm_loss(model, rows, tokenizer.pad_token_id), "warm start")
    model.eval()
    _save(path, model.state_dict(), {
        "task": task_identity, "steps": cfg.steps, "lr": cfg.lr, "batch_size": cfg.batch_size,
        "mix_batch_size": sizes, "schedule": cfg.lr_schedule, "warmup_steps": cfg.warmup_steps,
        "min_lr_ratio": cfg.min_lr_ratio,
        "final_loss": losses[-1], "mean_loss_last_10": sum(losses[-10:]) / len(losses[-10:]),
        "seconds": round(time.perf_counter() - t0, 1), "torch_cpu_capability": _cpu_capability(),
        "torch_threads": torch.get_num_threads()})
    return path


def mtp_warm_start(model: torch.nn.Module, tokenizer: Any, source: PromptSource, cfg: WarmStartConfig,
                   task_identity: dict[str, Any], examples: ExampleFn | None = None,
                   mix: list[tuple[PromptSource, ExampleFn]] = ()) -> str | None:
    """Fit the MTP layers of `model` (`glmlight.models.mtp`) on the warm start's rows, the main model frozen
    (or load the cached result): the same steps, batches and schedule as `supervised_warm_start`, on
    `masked_mtp_loss`. Run after it, so the layers learn on the main model's final hidden states. Returns the
    cache path; None without MTP layers or with cfg.steps = 0 or cfg.mtp false."""
    mtp = mtp_of(model)
    if mtp is None or cfg.steps <= 0 or not cfg.mtp:
        return None
    make_rows, _ = _row_maker(tokenizer, source, cfg, examples, mix)
    first = make_rows(0)
    key = warm_start_key(model, cfg, {"mtp": task_identity}, _fingerprint(first))
    path = os.path.join(cfg.cache_dir, f"warm_start_mtp-{key}.safetensors")
    if os.path.exists(path):
        mtp.load_state_dict(load_file(path))
        log.info("MTP warm start loaded from %s", path)
        return path
    log.info("MTP warm start: %d steps on the warm start's rows, the main model frozen (cached afterwards at %s)",
             cfg.steps, path)
    t0 = time.perf_counter()
    params = [p for p in mtp.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if p.requires_grad and all(p is not q for q in params)]
    for p in frozen:
        p.requires_grad_(False)
    model.train()
    try:
        losses = _fit(params, cfg, make_rows, first,
                      lambda rows: masked_mtp_loss(model, rows, tokenizer.pad_token_id)[0], "MTP warm start")
    finally:
        for p in frozen:
            p.requires_grad_(True)
        model.eval()
    _save(path, mtp.state_dict(), {
        "task": task_identity, "steps": cfg.steps, "lr": cfg.lr, "layers": len(mtp.layers),
        "first_loss": losses[0], "final_loss": losses[-1],
        "mean_loss_last_10": sum(losses[-10:]) / len(losses[-10:]),
        "seconds": round(time.perf_counter() - t0, 1), "torch_threads": torch.get_num_threads()})
    return path


def _cpu_capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001
        return "unknown"


def _batch(rows: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (ids, loss mask, attention mask), each [B, L]."""
    L = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    attn = torch.zeros((len(rows), L), dtype=torch.long)
    for i, (seq, m) in enumerate(rows):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = torch.tensor(m)
        attn[i, : len(seq)] = 1
    return ids, mask, attn


def masked_mtp_loss(model: torch.nn.Module, rows: list[Example], pad_id: int
                    ) -> tuple[torch.Tensor, list[float]]:
    """(the MTP depths' token-mean cross-entropy over the tokens whose mask is 1, averaged over depths; each
    depth's argmax accuracy). Depth d predicts token j from position j - d - 1 (`forward_logits_mtp`); the
    gradient reaches the MTP layers only."""
    from glmlight.models.glm5 import forward as glm_forward
    from glmlight.models.mtp_forward import hf_forward_logits_mtp
    from glmlight.ops.mtp import mtp_loss_terms

    ids, mask, attn = _batch(rows, pad_id)
    dev = next(model.parameters()).device
    ids, mask, attn = ids.to(dev), mask.to(dev), attn.to(dev)
    pos = torch.arange(ids.shape[1], device=dev).expand_as(ids)
    run = glm_forward.forward_logits_mtp if glm_forward.supports(model) else hf_forward_logits_mtp
    _, depths = run(model, ids, attn, pos)
    losses, accuracy = [], []
    for d, logits in enumerate(depths, start=1):  # entry i predicts token i + 1, from position i - d
        keep = mask[:, 1:].clone()
        keep[:, :d] = 0
        ce, correct, n = mtp_loss_terms(logits[:, :-1], ids[:, 1:], keep)
        losses.append(ce / n.clamp(min=1))
        accuracy.append(float(correct / n.clamp(min=1)))
    return torch.stack(losses).mean(), accuracy


def masked_lm_loss(model: torch.nn.Module, rows: list[Example], pad_id: int) -> torch.Tensor:
    """Token-mean cross-entropy over the tokens whose mask is 1 (each predicted from the ones before)."""
    ids, mask, attn = _batch(rows, pad_id)
    labels = torch.where(mask.bool(), ids, torch.tensor(-100))
    dev = next(model.parameters()).device
    logits = model(input_ids=ids.to(dev), attention_mask=attn.to(dev)).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             labels[:, 1:].reshape(-1).to(dev), ignore_index=-100)
