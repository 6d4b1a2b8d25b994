"""The embedded engine: the policy's own architecture in torch, in its own weight copy.

It keeps a private copy of the model (optionally in another dtype, e.g. bf16
while training runs in fp32), so train/inference mismatch is as real here as
with an external server.

Requests are served by continuous batching: `submit` queues a request and
returns a future; a background decode thread admits queued requests into the
running batch at the next decode step (their prompts are prefilled, then their
cache rows join the batch) and retires rows as soon as they finish. `generate`
is submit-all-then-wait. Weight updates take effect between two decode steps;
with `on_weight_update="continue"` running requests go on with the new weights
(`Generation.versions` records the version behind every token), with "abort"
they end at once with finish_reason "abort" and the tokens they have.

Three runners do the model work: `GlmDsaRunner` (GLM-5 / GlmMoeDsa and GLM-4.7-Flash /
Glm4MoeLite: preallocated per-row cache, few ops per step), `DenseRunner` (dense-attention
models: the Llama family and GLM-4.5 / Glm4Moe, the same layout) and `HFRunner` (any other
causal LM, through its own forward and a merged DynamicCache).

`speculative_depth=K` (rollout.speculative.depth): the GLM-5 runner drafts K tokens per round with the model's
first MTP layer, one target forward verifies them and speculative sampling accepts them, so the samples keep
the target's distribution exactly; a rule measured as it runs turns it off where it does not pay
(speculation.py).

`weight_format="fp8"`: the engine holds the linear weights of its copy in the block-quantised
FP8 layout of GLM-5 / DeepSeek-V3 FP8 checkpoints (float8_e4m3fn, one `weight_scale_inv` per
128 x 128 block; `glmlight.models.fp8`), quantised from the trainer's weights at every update,
and dequantised to `dtype` inside the matmuls (weight-only FP8, as FP8 servers run on hardware
without FP8 matmuls).
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import torch
from torch.nn.utils import parametrize
from transformers import PreTrainedModel

from glmlight.dtypes import resolve_dtype
from glmlight.errors import ConfigError, EngineError
from glmlight.models.fp8 import hold_for_engine
from glmlight.models.mtp import num_mtp_layers
from glmlight.ops.logprobs import logprobs_from_logits
from glmlight.engines.local import dense_runner, glm_runner
from glmlight.engines.base import Generation, NamedTensors, SamplingParams, normalize_requests
from glmlight.engines.local.batch import Request, RunningBatch, fill_holes, resolve_requests
from glmlight.engines.local.hf_runner import HFRunner
from glmlight.engines.local.sampling import request_spec_uniforms, request_uniforms
from glmlight.engines.local.speculation import SPEC_COUNTERS, Speculation
from glmlight.engines.transport import load_weights_file

log = logging.getLogger(__name__)

IDLE_EXIT_S = 2.0  # an idle decode thread exits after this long; the next submit starts another


class LocalEngine:
    """RolloutEngine running a private copy of a transformers causal LM in this process.

    `on_weight_update`: "continue" (in-flight requests decode on with the new weights)
    or "abort" (they finish at once with finish_reason "abort"). `max_batch_size`:
    rows decoded together; more requests wait in the queue. `runner`: "auto" (the
    GLM-5 runner for GlmMoeDsa and Glm4MoeLite models, the dense runner for Llama, Mistral, Qwen2,
    Qwen3 and Glm4Moe models it reproduces (`dense_runner.supports`), else the generic one), "glm",
    "dense" or "hf".
    `num_threads`: intra-op CPU threads of the decode thread (None: torch's setting).
    The default 1 suits the small models this engine runs on CPU: a decode step is
    hundreds of small ops, which splitting across cores slows down. Threads that have
    already run torch ops (the trainer's) keep their own setting.
    `compile`: run the GLM-5 or dense runner's decode steps, with the sampling of the running rows,
    as one `torch.compile`d graph (see `glm_runner`): the first decode step waits for the
    compile (10-30 s on CPU, which needs a C++ compiler), every later step is faster.
    `weight_format`: "auto" (every weight in `dtype`) or "fp8" (linear weights block-quantised to
    FP8 at every update, computed in `dtype`; see the module docstring).
    `share_prefill`: the GLM-5 and dense runners prefill a prompt once for all the requests admitted
    together with it (a GRPO group's samples, an evaluation's k answers) and copy its cache rows to the
    others, as servers with prefix caching do; False prefills each (for comparison: the `smollm2` bench).
    `filter_order`: how top-k and top-p combine when both are on (glmlight/ops/logprobs.py); this
    engine samples "sequential", the order the trainer uses for it (a server stand-in may set "joint"
    before generating).
    """

    filter_order = "sequential"
    seeded_sampling = True  # a request's seed fixes its samples (`SeedsSampling`, glmlight/engines/base.py)

    def __init__(self, model: PreTrainedModel, *, dtype: str | torch.dtype = "float32",
                 device: str | torch.device = "cpu", pad_token_id: int = 0, seed: int = 0, version: int = 0,
                 on_weight_update: str = "continue", max_batch_size: int = 256, runner: str = "auto",
                 num_threads: int | None = 1, compile: bool = False, weight_format: str = "auto",
                 share_prefill: bool = True, speculative_depth: int = 0, speculative_auto_off: bool = True,
                 speculative_probe_every: int = 32):
        if on_weight_update not in ("continue", "abort"):
            raise ValueError(f"on_weight_update must be 'continue' or 'abort', got {on_weight_update!r}")
        if runner not in ("auto", "glm", "dense", "hf"):
            raise ValueError(f"runner must be 'auto', 'glm', 'dense' or 'hf', got {runner!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        if compile and self.device.type not in ("cpu", "cuda"):
            raise EngineError(f"compile=True needs a cpu or cuda engine device (torch.compile's inductor), "
                              f"got {self.device}")
        if compile and self.device.type == "cpu" and not any(
                shutil.which(c) for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c):
            raise EngineError("compile=True on CPU needs a C++ compiler (g++ or clang++ on PATH, or $CXX): "
                              "torch.compile builds the decode step with it")
        self.model = copy.deepcopy(model).to(device=self.device, dtype=self.dtype).eval()
        self.model.requires_grad_(False)
        self.weight_format = weight_format
        self._fp8 = hold_for_engine(self.model, weight_format, self.dtype)  # {trainer name: Fp8Weight}
        self.pad_token_id = pad_token_id
        self.on_weight_update = on_weight_update
        self.max_batch_size = max_batch_size
        self.num_threads = num_threads
        self.share_prefill = share_prefill
        torch.get_num_threads()  # fixes this thread's own count before the decode thread sets its own
        if runner == "glm" and not glm_runner.supports(self.model):
            raise EngineError(f"runner='glm' needs a GlmMoeDsaForCausalLM or Glm4MoeLiteForCausalLM it reproduces, "
                              f"got {type(model).__name__}")
        if runner == "dense" and not dense_runner.supports(self.model):
            raise EngineError(f"runner='dense' cannot run this model: {dense_runner.unsupported_reason(self.model)}")
        kind = runner if runner != "auto" else (
            "glm" if glm_runner.supports(self.model) else "dense" if dense_runner.supports(self.model) else "hf")
        if compile and kind == "hf":
            raise EngineError(f"compile=True needs the GLM-5 or the dense runner, got "
                              f"{type(model).__name__} with runner={runner!r}")
        if kind == "glm":
            self._runner = glm_runner.GlmDsaRunner(self.model, compile=compile)
        elif kind == "dense":
            self._runner = dense_runner.DenseRunner(self.model, compile=compile)
        else:
            self._runner = HFRunner(self.model, pad_token_id)
            why = glm_runner.unsupported_reason(self.model) or dense_runner.unsupported_reason(self.model)
            log.info("engine: %s decodes through its own forward (the generic runner; the fast runners are for "
                     "GlmMoeDsa, Glm4MoeLite, Glm4Moe and dense Llama-family models: %s)", type(model).__name__, why)
        self.runner_kind = kind
        self._spec: Speculation | None = None
        if speculative_depth:
            self._spec = self._speculation(speculative_depth, speculative_auto_off, speculative_probe_every, compile)
        self._generator = torch.Generator().manual_seed(seed)
        self._version = version
        self._lock = threading.RLock()  # the model, the runner and the running batch: one decode step at a time
        # Held by a caller from outside while it waits for `_lock`; the decode thread passes it before
        # every step, so a weight update waits for one step, not for a gap between steps (Python's
        # locks are not fair: a loop that releases and re-acquires at once would starve the caller).
        self._turn = threading.Lock()
        self._cv = threading.Condition()  # the queue and the decode thread's life
        self._pending: deque[Request] = deque()
        self._admitting: list[Request] = []  # taken from the queue, not yet in the batch
        self._batch = RunningBatch(self.device, self.filter_order, self._spec is not None)
        self._batch.mark_version(0, version)
        self._iteration = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self.last_sync_bytes = 0
        self._stats = dict(iterations=0, decode_steps=0, prefills=0, admitted=0, admitted_mid_decode=0,
                           shared_prefills=0, max_batch=0, tokens=0, aborted=0)
        if self._spec is not None:
            self._stats.update(dict.fromkeys(SPEC_COUNTERS, 0))
        self.on_step: Callable[[int], None] | None = None  # called by the decode thread after each step
        self._capture = (False, False)  # replay records: (routing, index), for requests admitted from
        self._capture_since = 0  # this engine iteration on
        self._unserved: str | None = None  # why the engine refuses requests (a weight update failed half-way)
        self._stale: set[str] = set()  # the weights such an update named: the next one must name them all

    def _speculation(self, depth: int, auto_off: bool, probe_every: int, compile: bool) -> Speculation:
        """Speculative decoding with the model's MTP layers (speculation.py); ConfigError where it cannot run."""
        key = f"rollout.speculative.depth={depth}"
        if depth < 0:
            raise ConfigError(f"config error: {key} must be >= 0")
        if num_mtp_layers(self.model) == 0:
            raise ConfigError(f"config error: {key} drafts with the policy's MTP layers and this "
                              f"{type(self.model).__name__} has none (model.mtp.layers=N gives it N)")
        if self.runner_kind != "glm":
            raise ConfigError(f"config error: {key} needs the embedded engine's GLM-5 runner (GlmMoeDsa, "
                              f"Glm4MoeLite models); the {self.runner_kind} runner of {type(self.model).__name__} "
                              "cannot draft")
        if compile:
            raise ConfigError(f"config error: {key} decodes eagerly: set rollout.compile=false")
        self._runner.enable_speculation()
        return Speculation(depth, auto_off=auto_off, probe_every=probe_every)

    def speculation(self) -> Speculation | None:
        """The speculative decoder and its on/off state (None when the engine does not speculate)."""
        return self._spec

    # ----------------------------------------------------------------- protocol
    @property
    def version(self) -> int:
        return self._version

    def stats(self) -> dict[str, int]:
        """Counters of the decode loop: iterations, decode_steps (steps over an already running
        batch), prefills, admitted, admitted_mid_decode (requests that joined a batch that was
        decoding), shared_prefills (admitted requests whose prompt was prefilled once for an identical one
        admitted with it: the fast runners' copies), max_batch (largest batch sampled in one step), tokens,
        aborted; with speculative decoding also `SPEC_COUNTERS` (speculation.py: drafted and accepted
        drafts, the running rows' decode rounds, row forwards and tokens, rounds with speculation on)."""
        with self._cv:
            return dict(self._stats)

    def state_dict(self) -> dict[str, Any]:
        """The seed stream of unseeded requests (checkpointed, so a resumed run samples the same)."""
        with self._cv:
            return {"generator": self._generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._cv:
            self._generator.set_state(state["generator"])

    def capture_replay(self, routing: bool = False, index: bool = False) -> None:
        """Record, for every request admitted from now on, the expert ids each MoE layer chose
        (`routing`) and/or the DSA selection of each layer with its own indexer (`index`) for every
        token it runs, prompt and response: `Generation.routed_experts` / `.indexer_topk`. Adds to
        what is recorded already. Raises EngineError when the runner or the model cannot."""
        with self._turn, self._lock:
            want = (routing or self._capture[0], index or self._capture[1])
            if want == self._capture:
                return
            set_capture = getattr(self._runner, "set_capture", None)
            if set_capture is None:
                raise EngineError(f"the {type(self._runner).__name__} runner cannot capture replay records")
            set_capture(*want)
            self._capture, self._capture_since = want, self._iteration

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Future:
        """Queue one request; the future resolves to its Generation. Never blocks on decoding."""
        if not prompt_ids:
            raise ValueError("prompt is empty")
        with self._cv:
            if self._closed:
                raise EngineError("the engine is closed")
            if self._unserved:
                raise EngineError(self._unserved)
            seed = params.seed if params.seed is not None else int(
                torch.randint(2**62, (1,), generator=self._generator))
            req = Request(list(prompt_ids), params, seed, request_uniforms(seed, params.max_new_tokens))
            if self._spec is not None:
                req.spec_uniforms = request_spec_uniforms(seed, params.max_new_tokens)
            req.future.set_running_or_notify_cancel()
            self._pending.append(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="glmlight-decode", daemon=False)
                self._thread.start()
            self._cv.notify_all()
        return req.future

    def generate(self, prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[Generation]:
        if not prompts:
            return []
        params = normalize_requests(prompts, params)
        if threading.current_thread() is self._thread:
            raise EngineError("generate() called from the decode thread (e.g. in on_step); use submit()")
        # Queued in one go, so a running decode thread admits them together (when there is room): which
        # requests share a decode step changes log-probs by float rounding, and must not depend on timing.
        with self._cv:
            futures = [self.submit(p, sp) for p, sp in zip(prompts, params)]
        return [f.result() for f in futures]

    def abort_all(self) -> int:
        """End every queued and running request now (finish_reason "abort"); returns how many."""
        with self._turn, self._lock:
            done = self._abort_locked()
        resolve_requests(done)
        return len(done)

    def abort(self, futures: Sequence[Future]) -> int:
        """End the requests behind these futures (from `submit`) now, queued or running, with
        finish_reason "abort" and the tokens they have; the others go on. Returns how many ended."""
        wanted = set(futures)
        with self._turn, self._lock:
            with self._cv:
                gone = [r for r in self._pending if r.future in wanted]
                self._pending = deque(r for r in self._pending if r.future not in wanted)
            done = [(r, Generation([], [], "abort", [])) for r in gone]
            rows = [i for i, r in enumerate(self._batch.requests) if r.future in wanted]
            if rows:
                with torch.inference_mode():
                    done += self._batch.finish(rows, reason="abort")
                    order = fill_holes(len(self._batch), rows)
                    self._batch.keep(order)
                    self._runner.keep(order)
            with self._cv:
                self._stats["aborted"] += len(done)
        resolve_requests(done)
        return len(done)

    def score(self, prompts: list[list[int]], completions: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """Prefill log-probs of each completion token (e.g. a teacher's log-probs of the student's tokens)."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        with self._turn, self._lock, torch.inference_mode():
            if self._unserved:
                raise EngineError(self._unserved)
            seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
            L = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), L), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, s in enumerate(seqs):
                ids[i, : len(s)] = torch.tensor(s)
                mask[i, : len(s)] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            with parametrize.cached():  # FP8 weights: dequantised once per call
                logits = self.model(input_ids=ids, attention_mask=mask).logits
            lp = logprobs_from_logits(logits[:, :-1], ids[:, 1:], temperature)
            return [lp[i, len(p) - 1 : len(p) - 1 + len(c)].tolist() for i, (p, c) in enumerate(zip(prompts, completions))]

    def update_weights(self, named_tensors: NamedTensors | None = None, *, path: str | None = None, version: int) -> None:
        """Load new weights between two decode steps; then serve `version` (see `on_weight_update`).

        All or nothing, as for the servers: every tensor is checked first (a parameter of the model, its
        shape, a dtype it converts from, a tensor with data), so a refused update (EngineError) writes no
        weight and the engine serves what it served. A stream that gathers its tensors as it is read (the
        sharded `glmlight.strategies.fsdp.full_weights`) is checked from its `manifest()` before the first is
        gathered; anything else is listed (references, no copies). Writing the checked tensors can then fail
        only for want of resources; if it fails after a weight was written, or the runner cannot re-read
        the weights, the engine ends every request ("abort"), raises EngineError and refuses to generate or
        score until an update that names every weight of the failed one succeeds: no weight is copied
        to roll back (the update's cost: docs/performance.md)."""
        if (named_tensors is None) == (path is None):
            raise ValueError("update_weights needs exactly one of named_tensors or path")
        if path is not None:
            named_tensors = load_weights_file(path).items()
        done: list = []
        try:
            with self._turn, self._lock, torch.no_grad():
                if self.model is None:
                    raise EngineError("the engine is closed")
                state = self.model.state_dict()
                manifest = getattr(named_tensors, "manifest", None)
                if callable(manifest):  # checked from its manifest; each tensor again as it arrives
                    names = []
                    for name, shape, dtype in manifest():
                        self._check(state, version, name, tuple(shape), dtype)
                        names.append(name)
                else:
                    named_tensors = list(named_tensors)
                    names = [name for name, _ in named_tensors]
                    for name, tensor in named_tensors:
                        self._check_tensor(state, version, name, tensor)
                missing = self._stale.difference(names)
                if missing:
                    raise EngineError(f"weight update to version {version} refused: the engine's weights are mixed "
                                      f"since a failed update, and this one leaves {len(missing)} of them out "
                                      f"(e.g. {sorted(missing)[0]!r}); send every weight")
                nbytes = 0
                try:
                    for name, tensor in named_tensors:
                        if callable(manifest):
                            names.append(name)
                            self._check_tensor(state, version, name, tensor)
                        self._write(state, name, tensor)
                        nbytes += tensor.numel() * tensor.element_size()
                    self._runner.refresh()  # the runner's fused (and packed) copies of the new weights
                except BaseException as e:
                    self._stale.update(names)
                    self._unserved = (f"a weight update to version {version} failed after weights were written "
                                      f"({type(e).__name__}: {e}); the engine serves no request until an "
                                      f"update of every weight succeeds")
                    done = self._abort_locked()  # no request decodes on with weights of no version
                    if isinstance(e, Exception):
                        raise EngineError(self._unserved) from e
                    raise
                self._stale.clear()
                self._unserved = None
                self.last_sync_bytes = nbytes
                if self.on_weight_update == "abort":
                    done = self._abort_locked()
                self._version = version
                self._batch.mark_version(self._iteration, version)
        finally:
            resolve_requests(done)

    def _check(self, state: dict[str, torch.Tensor], version: int, name: str, shape: tuple[int, ...],
               dtype: torch.dtype) -> None:
        """Refuse (EngineError) a tensor that `_write` could not write: an unknown name, another shape, a
        dtype it does not convert from (only floating point into a floating-point weight)."""
        if name in self._fp8:
            want, want_dtype = tuple(self._fp8[name].stored.shape), torch.float32  # quantised from any float
        elif name in state:
            want, want_dtype = tuple(state[name].shape), state[name].dtype
        else:
            raise EngineError(f"weight update to version {version} refused: unknown parameter {name!r}")
        if shape != want:
            raise EngineError(f"weight update to version {version} refused: {name!r} has shape {shape}, "
                              f"engine expects {want}")
        if dtype != want_dtype and not (dtype.is_floating_point and want_dtype.is_floating_point):
            raise EngineError(f"weight update to version {version} refused: {name!r} has dtype {dtype}, "
                              f"engine expects {'a floating-point dtype' if want_dtype.is_floating_point else want_dtype}")

    def _check_tensor(self, state: dict[str, torch.Tensor], version: int, name: str, tensor: Any) -> None:
        """`_check`, and that `tensor` is a plain tensor with data (not meta, sparse, nested, quantised
        or a DTensor shard)."""
        if not isinstance(tensor, torch.Tensor):
            raise EngineError(f"weight update to version {version} refused: {name!r} is a "
                              f"{type(tensor).__name__}, not a tensor")
        if (tensor.is_meta or tensor.layout != torch.strided or tensor.is_nested or tensor.is_quantized
                or type(tensor).__name__ == "DTensor"):
            raise EngineError(f"weight update to version {version} refused: {name!r} is not a dense tensor "
                              f"with data (device {tensor.device}, layout {tensor.layout}, {type(tensor).__name__})")
        self._check(state, version, name, tuple(tensor.shape), tensor.dtype)

    def _write(self, state: dict[str, torch.Tensor], name: str, tensor: torch.Tensor) -> None:
        """Write one checked tensor into the engine's model (an FP8-held weight: quantised from it)."""
        if name in self._fp8:
            self._fp8[name].load_(tensor)
        else:
            state[name].copy_(tensor)

    # ----------------------------------------------------------------- the decode thread
    # Each iteration steps the running rows (or, with speculative decoding, runs a speculative round over
    # them: speculation.py), admits queued requests into the batch (their prompts prefilled), samples, and
    # retires the rows that finished; the thread exits after `IDLE_EXIT_S` idle (the next submit starts
    # another).
    def _attach_records(self, done: list[tuple[Request, Generation]], rows: list[int]) -> None:
        """Replay records of finished rows (requests admitted while capturing; aborts get none)."""
        for (req, gen), row in zip(done, rows):
            if req.first_iteration >= self._capture_since and gen.finish_reason != "abort":
                gen.routed_experts, gen.indexer_topk = self._runner.records(row)

    def _loop(self) -> None:
        if self.num_threads and self.device.type == "cpu":
            torch.set_num_threads(self.num_threads)  # per thread: the caller keeps its own
        idle_since = time.monotonic()
        while True:
            with self._cv:
                while not self._pending and not len(self._batch) and not self._closed:
                    if time.monotonic() - idle_since > IDLE_EXIT_S or not threading.main_thread().is_alive():
                        self._thread = None  # a later submit starts a new one
                        return
                    self._cv.wait(0.1)
                if self._closed:
                    return
            try:
                done = self._step()
            except BaseException as e:  # fail what was in flight, keep serving
                with self._lock:
                    done = [(r, e) for r in self._batch.requests + self._admitting]
                    self._admitting = []
                    self._batch = RunningBatch(self.device, self.filter_order, self._spec is not None)
                    self._batch.mark_version(self._iteration, self._version)
                    if self._runner is not None:
                        self._runner.reset()
                if not isinstance(e, Exception):  # interpreter shutdown and the like: stop here
                    resolve_requests(done)
                    with self._cv:
                        self._thread = None
                    raise
            resolve_requests(done)
            idle_since = time.monotonic()
            hook = self.on_step
            if hook is not None:
                try:
                    hook(self._iteration)
                except Exception:  # a monitoring hook must not stop the engine
                    log.exception("LocalEngine.on_step hook failed")

    def _take_pending(self) -> list[Request]:
        with self._cv:
            room = self.max_batch_size - len(self._batch)
            if len(self._batch) and not self._runner.can_merge:
                room = 0
            take = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
            self._stats["admitted"] += len(take)
            self._stats["admitted_mid_decode"] += len(take) if len(self._batch) else 0
            return take

    def _step(self) -> list[tuple[Request, Generation]]:
        """One decode iteration: step the running rows, admit newcomers, sample, retire finished rows."""
        with self._turn:  # let a waiting weight update (or abort, score, close) go first
            pass
        with self._lock, torch.inference_mode():
            if self.model is None:
                return []
            batch, runner, spec = self._batch, self._runner, self._spec
            self._admitting = self._take_pending()
            running = len(batch)
            speculate = bool(running) and spec is not None and spec.choose()
            spec_on = spec is not None and spec.on  # (before this round's measurement may turn it off or on)
            # (tokens, log-probs) of the running rows (sampled inside a compiled step), then of newcomers
            sampled, spec_done = [], None
            if speculate:  # several tokens per running row (speculation.py)
                tok, lp, accepted = spec.round(runner, batch)
                spec_done, recorded = batch.record_many(tok, lp, accepted + 1, self._iteration)
                runner.advance(recorded)
                self._count_speculation(running, spec_on, recorded, accepted)
            elif running:
                t0 = time.perf_counter() if spec is not None else 0.0
                sampled = [runner.step(batch.last, batch.sampler())]
                if spec is not None:
                    spec.note_plain(time.perf_counter() - t0)
                    self._count_speculation(running, spec_on, None, None)
            shared_prefills = 0
            if self._admitting:
                prompts = [r.prompt for r in self._admitting]
                # the fast runners prefill a prompt once for all its copies (the generic runner, each)
                shared = self.share_prefill and hasattr(runner, "admit_shared")
                logits = runner.admit_shared(prompts) if shared else runner.admit(prompts)
                shared_prefills = len(prompts) - len({tuple(p) for p in prompts}) if shared else 0
                batch.add(self._admitting, self._iteration)
                self._admitting = []
                sampled.append(batch.sampler(running)(logits))
            if spec_done is not None:
                finished = spec_done
                if sampled:  # newcomers: their first token
                    tok, lp = sampled[0]
                    new_done, _ = batch.record_many(tok[:, None], lp[:, None], torch.ones_like(tok), self._iteration,
                                                    lo=running)
                    finished = torch.cat([spec_done, new_done])
            elif not sampled:
                return []
            else:
                finished = batch.record(*(sampled[0] if len(sampled) == 1 else map(torch.cat, zip(*sampled))),
                                        iteration=self._iteration)
            self._iteration += 1
            n = len(batch)
            rows = finished.nonzero()[:, 0].tolist()
            done = batch.finish(rows)
            if self._capture != (False, False):
                self._attach_records(done, rows)
            if rows:
                order = fill_holes(n, rows)
                batch.keep(order)
                runner.keep(order)
            with self._cv:
                s = self._stats
                s["iterations"] += 1
                s["decode_steps"] += running > 0
                s["prefills"] += n > running
                s["shared_prefills"] += shared_prefills
                s["max_batch"] = max(s["max_batch"], n)
                s["tokens"] += n if spec_done is None else n - running + int(recorded.sum())
            return done

    def _count_speculation(self, running: int, on: bool, recorded: torch.Tensor | None,
                           accepted: torch.Tensor | None) -> None:
        """The speculation counters of `stats` after a decode round of `running` rows (plain: recorded None),
        `on`: whether speculation was on when the round was chosen."""
        with self._cv:
            s = self._stats
            s["spec_decode_rounds"] += 1
            s["spec_on_rounds"] += int(on)
            s["spec_row_forwards"] += running
            s["spec_decode_tokens"] += running if recorded is None else int(recorded.sum())
            if accepted is not None:
                s["spec_drafted"] += running * self._spec.depth
                s["spec_accepted"] += int(accepted.sum())

    def _abort_locked(self) -> list[tuple[Request, Generation]]:
        """End all queued and running requests with "abort" (caller holds the lock)."""
        with self._cv:
            pending, self._pending = list(self._pending), deque()
        done = [(r, Generation([], [], "abort", [])) for r in pending]
        with torch.inference_mode():
            done += self._batch.finish(list(range(len(self._batch))), reason="abort")
            self._batch.keep([])
        if self._runner is not None:
            self._runner.reset()
        with self._cv:
            self._stats["aborted"] += len(done)
        return done

    def __enter__(self) -> "LocalEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the decode thread (in-flight requests end with "abort") and release the model."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._turn, self._lock:
            done = self._abort_locked()
            self.model = self._runner = None
        resolve_requests(done)
