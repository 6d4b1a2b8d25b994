"""Outcome reward models: a local sequence-classification checkpoint, or a remote endpoint.

Both score the text of (prompt, completion). The completion is the decoded action
text the data module stores in `metadata["completion_text"]`; the prompt is
`metadata["prompt_text"]` when a source provides it, else the prompt ids decoded
with the policy's tokenizer (`policy_tokenizer`: a local tokenizer directory, or
None for the built-in character tokenizer), special tokens dropped. Decoding here
only feeds a separate scoring model; the action stays token ids.

Remote protocol: `POST <url>` with JSON `{"prompt": str, "completion": str}`,
answer JSON `{"score": number}` (HTTP 200). Anything else raises a ValueError
naming the URL, which the reward machinery counts as a failed sample.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
from typing import Any

import torch

from glmlight.rewards.verifiers import completion_text
from glmlight.sample import Sample

_tokenizers: dict[str | None, Any] = {}


def cached_tokenizer(path: str | None, key: str = "task.reward.policy_tokenizer") -> Any:
    """A tokenizer (cached per path): a local directory, or the built-in character tokenizer."""
    if path not in _tokenizers:
        from glmlight.models.loading import load_tokenizer

        _tokenizers[path] = load_tokenizer(path, key=key)
    return _tokenizers[path]


def prompt_text(sample: Sample, tokenizer_path: str | None = None) -> str:
    """The prompt as text: metadata["prompt_text"], else the prompt ids decoded without special tokens."""
    text = sample.metadata.get("prompt_text")
    if text is not None:
        return str(text)
    return cached_tokenizer(tokenizer_path).decode(list(sample.prompt_ids), skip_special_tokens=True)


class SequenceClassifierReward:
    """An outcome reward model from a local `AutoModelForSequenceClassification` checkpoint.

    One label: the reward is its logit (`normalize="sigmoid"` maps it to (0, 1)).
    Several labels: the softmax probability of `label_index` (default: the last label).
    The input is the RM tokenizer's chat template over [user: prompt, assistant: completion]
    when it has one, else `template` with {prompt} and {completion}.
    """

    def __init__(self, path: str, *, device: str = "cpu", dtype: str = "float32", max_length: int = 2048,
                 label_index: int | None = None, normalize: str = "none", use_chat_template: bool = True,
                 template: str = "{prompt}\n{completion}", policy_tokenizer: str | None = None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from glmlight.dtypes import resolve_dtype

        if not os.path.isdir(path):
            raise ValueError(f"reward model path {path!r} is not a local directory (checkpoints are never downloaded)")
        if normalize not in ("none", "sigmoid"):
            raise ValueError(f"SequenceClassifierReward.normalize must be none or sigmoid, got {normalize!r}")
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, local_files_only=True, use_safetensors=True, dtype=resolve_dtype(dtype)).to(device).eval()
        self.model.requires_grad_(False)
        if self.model.config.pad_token_id is None and self.tokenizer.pad_token_id is not None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device, self.max_length, self.normalize = torch.device(device), max_length, normalize
        num_labels = self.model.config.num_labels
        self.label_index = num_labels - 1 if label_index is None else label_index
        if not 0 <= self.label_index < num_labels:
            raise ValueError(f"label_index={label_index} is out of range for a model with {num_labels} labels")
        self.use_chat_template = use_chat_template and bool(getattr(self.tokenizer, "chat_template", None))
        self.template = template
        self.policy_tokenizer = policy_tokenizer
        self._lock = threading.Lock()

    def text(self, prompt: str, completion: str) -> str:
        if self.use_chat_template:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}], tokenize=False)
        return self.template.replace("{prompt}", prompt).replace("{completion}", completion)

    @torch.inference_mode()
    def score_text(self, prompt: str, completion: str) -> float:
        enc = self.tokenizer(self.text(prompt, completion), return_tensors="pt", truncation=True,
                             max_length=self.max_length)
        with self._lock:
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits[0].float()
        if logits.numel() == 1:
            value = logits[0]
            return float(torch.sigmoid(value) if self.normalize == "sigmoid" else value)
        return float(torch.softmax(logits, -1)[self.label_index])

    def __call__(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        return self.score_text(prompt_text(sample, self.policy_tokenizer), completion_text(sample)), {}


class RemoteRewardModel:
    """An outcome reward model behind HTTP: POST {prompt, completion} -> {score}.

    Connection errors, timeouts and 5xx answers are retried `max_retries` times with
    exponential backoff; 4xx answers and malformed bodies are not. The API key, if
    any, is read from the environment variable named by `api_key_env` (sent as
    `Authorization: Bearer <key>`, never logged). Async: the samples of a batch are
    scored concurrently, at most `max_concurrency` requests at a time.
    """

    def __init__(self, url: str, *, timeout_s: float = 30.0, max_retries: int = 2, retry_backoff_s: float = 0.2,
                 api_key_env: str | None = None, score_key: str = "score", max_concurrency: int = 32,
                 policy_tokenizer: str | None = None):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward endpoint url must start with http:// or https://, got {url!r}")
        self.url, self.timeout_s, self.max_retries, self.retry_backoff_s = url, timeout_s, max_retries, retry_backoff_s
        self.api_key_env, self.score_key, self.max_concurrency = api_key_env, score_key, max_concurrency
        self.policy_tokenizer = policy_tokenizer
        self._semaphores: dict[int, asyncio.Semaphore] = {}

    def __getstate__(self) -> dict[str, Any]:  # semaphores belong to one event loop; a copy starts without
        return {**self.__dict__, "_semaphores": {}}

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ValueError(f"reward endpoint: environment variable {self.api_key_env} is not set")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if id(loop) not in self._semaphores:  # one per event loop (each batch may run in a fresh loop)
            self._semaphores = {id(loop): asyncio.Semaphore(self.max_concurrency)}
        return self._semaphores[id(loop)]

    async def __call__(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        payload = {"prompt": prompt_text(sample, self.policy_tokenizer), "completion": completion_text(sample)}
        async with self._semaphore():
            body = await self._post(payload)
        return self._parse(body), {}

    async def _post(self, payload: dict[str, Any]) -> Any:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            try:
                async with (aiohttp.ClientSession(timeout=timeout) as session,
                            session.post(self.url, json=payload, headers=self._headers()) as resp):
                    text = await resp.text()
                    if resp.status >= 500:
                        last = f"HTTP {resp.status}: {text[:200]}"
                        continue
                    if resp.status != 200:
                        raise ValueError(f"reward endpoint {self.url} answered HTTP {resp.status}: {text[:200]}")
                    try:
                        return await resp.json(content_type=None)
                    except ValueError:
                        raise ValueError(f"reward endpoint {self.url} answered non-JSON: {text[:200]!r}") from None
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
        raise ValueError(f"reward endpoint {self.url} failed after {self.max_retries + 1} attempts ({last})")

    def _parse(self, body: Any) -> float:
        if not isinstance(body, dict) or self.score_key not in body:
            raise ValueError(f"reward endpoint {self.url} answer has no {self.score_key!r} field: {str(body)[:200]}")
        value = body[self.score_key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"reward endpoint {self.url} returned a non-numeric or non-finite score: {value!r}")
        return float(value)
