"""The embedded engine: the policy's own architecture in torch, in its own weight copy.

It keeps a private copy of the model (optionally in another dtype, e.g. bf16
while training runs in fp32), so train/inference mismatch is as real here as
with an external server. Generation is batched with a KV cache; rows that finish
leave the batch, so the remaining ones decode without padding work.
"""

from __future__ import annotations

import copy
import os
import threading
from typing import Sequence

import torch
from safetensors.torch import load_file
from transformers import DynamicCache, PreTrainedModel

from glmlight.errors import EngineError
from glmlight.ops.logprobs import logprobs_from_logits
from glmlight.rollout.base import Generation, NamedTensors, SamplingParams
from glmlight.rollout.sampling import sample_tokens

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


class LocalEngine:
    """RolloutEngine running a private copy of a transformers causal LM in this process."""

    def __init__(self, model: PreTrainedModel, *, dtype: str | torch.dtype = "float32",
                 device: str | torch.device = "cpu", pad_token_id: int = 0, seed: int = 0, version: int = 0):
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        self.model = copy.deepcopy(model).to(device=self.device, dtype=self.dtype).eval()
        self.model.requires_grad_(False)
        self.pad_token_id = pad_token_id
        self._generator = torch.Generator(self.device).manual_seed(seed)
        self._version = version
        self._lock = threading.RLock()
        self.last_sync_bytes = 0

    # ----------------------------------------------------------------- protocol
    @property
    def version(self) -> int:
        return self._version

    def generate(self, prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[Generation]:
        if not prompts:
            return []
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
        with self._lock, torch.inference_mode():
            return self._generate(prompts, list(params))

    def score(self, prompts: list[list[int]], completions: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """Prefill log-probs of each completion token (e.g. a teacher's log-probs of the student's tokens)."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        with self._lock, torch.inference_mode():
            seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
            L = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), L), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, s in enumerate(seqs):
                ids[i, : len(s)] = torch.tensor(s)
                mask[i, : len(s)] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            logits = self.model(input_ids=ids, attention_mask=mask).logits
            lp = logprobs_from_logits(logits[:, :-1], ids[:, 1:], temperature)
            return [lp[i, len(p) - 1 : len(p) - 1 + len(c)].tolist() for i, (p, c) in enumerate(zip(prompts, completions))]

    def update_weights(self, named_tensors: NamedTensors | None = None, *, path: str | None = None, version: int) -> None:
        if (named_tensors is None) == (path is None):
            raise ValueError("update_weights needs exactly one of named_tensors or path")
        if path is not None:
            named_tensors = _load_safetensors(path).items()
        with self._lock, torch.no_grad():
            state = self.model.state_dict()
            nbytes = 0
            for name, tensor in named_tensors:
                if name not in state:
                    raise EngineError(f"weight update names unknown parameter {name!r}")
                if state[name].shape != tensor.shape:
                    raise EngineError(f"weight update for {name!r} has shape {tuple(tensor.shape)}, "
                                      f"engine expects {tuple(state[name].shape)}")
                state[name].copy_(tensor)
                nbytes += tensor.numel() * tensor.element_size()
            self.last_sync_bytes = nbytes
            self._version = version

    def close(self) -> None:
        self.model = None

    # ----------------------------------------------------------------- decoding
    def _generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Generation]:
        B, dev = len(prompts), self.device
        P = max(len(p) for p in prompts)
        input_ids = torch.full((B, P), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((B, P), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
            attention[i, P - len(p):] = 1
        input_ids, attention = input_ids.to(dev), attention.to(dev)
        position = (attention.cumsum(-1) - 1).clamp(min=0)

        temperature = torch.tensor([p.temperature for p in params], device=dev)
        top_k = torch.tensor([p.top_k for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        max_new = torch.tensor([p.max_new_tokens for p in params], device=dev)
        stop_sets = [set(p.stop_token_ids) for p in params]
        seeded = any(p.seed is not None for p in params)
        generators = [torch.Generator(dev).manual_seed(p.seed if p.seed is not None else
                                                       int(torch.randint(2**62, (1,), generator=self._generator)))
                      for p in params] if seeded else None

        out_tokens: list[list[int]] = [[] for _ in range(B)]
        out_logps: list[list[float]] = [[] for _ in range(B)]
        finish = ["length"] * B
        alive = torch.arange(B, device=dev)  # original row index of each row still decoding
        cache = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=input_ids, attention_mask=attention, position_ids=position,
                            cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        next_pos = position[:, -1:] + 1
        for step in range(int(max_new.max())):
            gens = [generators[i] for i in alive.tolist()] if generators else self._generator
            tok, lp = sample_tokens(logits, temperature[alive], top_k[alive], top_p[alive], gens)
            keep = []
            for j, (row, t, l) in enumerate(zip(alive.tolist(), tok.tolist(), lp.tolist())):
                out_tokens[row].append(t)
                out_logps[row].append(l)
                if t in stop_sets[row]:
                    finish[row] = "stop"
                elif len(out_tokens[row]) < int(max_new[row]):
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(alive):
                idx = torch.tensor(keep, device=dev)
                cache.batch_select_indices(idx)
                alive, tok, attention, next_pos = alive[idx], tok[idx], attention[idx], next_pos[idx]
            attention = torch.cat([attention, attention.new_ones(len(alive), 1)], dim=1)
            logits = self.model(input_ids=tok.unsqueeze(-1), attention_mask=attention, position_ids=next_pos,
                                cache=cache, use_cache=True).logits[:, -1]
            next_pos = next_pos + 1
        v = self._version
        return [Generation(token_ids=out_tokens[i], logprobs=out_logps[i], finish_reason=finish[i],
                           versions=[v] * len(out_tokens[i])) for i in range(B)]


def _load_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Tensors of a Hugging Face checkpoint directory (through transformers, which maps its
    on-disk names to the model's), of a directory of raw *.safetensors files, or of one file."""
    if os.path.isfile(os.path.join(path, "config.json")):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True).state_dict()
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise EngineError(f"no .safetensors files in {path}")
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(os.path.join(path, f)))
        return out
    if not os.path.exists(path):
        raise EngineError(f"weight file {path} does not exist")
    return load_file(path)
