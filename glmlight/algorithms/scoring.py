"""How an RL module scores tokens (`PolicyScoring`, an object `RLModule` holds): the trainer-side logits
over a batch's responses, log-probs and entropy under the engine's sampling distribution (temperature,
top-k, top-p), and the reference model's log-probs.

Per-turn sampling: tokens drawn with other settings than the run's (the agent gateway's
`client_sampling`; `Experience.sampling`, glmlight/sample.py) are scored at the temperature, top-k and
top-p they were drawn with, a per-token division and per-row filtering in the same log-prob op; a batch
without such tokens (the common case) is scored with the run's numbers, as before.

Replay scope (`algo.replay`): the records are the choices the policy made in the engine, so only the
policy's own forwards replay them (the old log-probs and the update). The frozen reference, a LoRA
policy's frozen base and trainer-side OPD teachers are other distributions: they route and select
keys by themselves, as slime's routing replay falls through for its reference and teacher forwards
(slime/utils/routing_replay.py) and as an engine serving them would."""

from __future__ import annotations

import torch

from glmlight.algorithms import replay as replay_
from glmlight.algorithms.parallel import ParallelSteps
from glmlight.models import shared_prompt
from glmlight.models.glm5 import forward as glm_forward
from glmlight.models.glm5.replay import transformers_replay
from glmlight.models.lora import base_model_context
from glmlight.models.mtp_forward import hf_forward_logits_mtp
from glmlight.ops.logprobs import entropy_from_logits, logprobs_from_logits
from glmlight.sample import Experience

LOGPROB_FLOOR = -1e4  # the trainer's log-prob of a token outside its top-k / top-p kept set
ENTROPY_CHUNK_ELEMENTS = 1 << 20  # logits per chunk of the entropy computed without gradient (4 MB in float32)


def takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the model's forward (under peft's wrappers) takes `logits_to_keep` (transformers' causal LMs)."""
    import inspect

    inner = model
    for attr in ("base_model", "model"):  # peft: PeftModel.base_model (LoraModel).model
        if type(inner).__name__.startswith(("Peft", "Lora")) and hasattr(inner, attr):
            inner = getattr(inner, attr)
    try:
        return "logits_to_keep" in inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return False


class PolicyScoring:
    """How an RL module (glmlight/algorithms/base.py) scores tokens; it holds one.

    Args:
        policy: the trained model (its own forwards replay the engine's records with `replay_mode`).
        parallel: the module's `ParallelSteps` (micro-batches, whether the models are sharded).
        temperature, top_k, top_p: the run's sampling distribution (rollout.*).
        filter_order: how the engine whose rollouts are scored combines top-k and top-p
            (glmlight/ops/logprobs.py; the builder takes it from the engine).
        replay_mode: algo.replay (glmlight/algorithms/replay.py).
        use_glm_forward: logits through glmlight.models.glm5.forward (model.forward).
        share_prompt_forward: algo.share_prompt_forward (glmlight/models/shared_prompt.py).
        reference: the frozen reference model, or none (a list of at most one, outside the module's parameters).
        reference_is_base: the reference is the LoRA policy's own frozen base (its adapters disabled).
    """

    def __init__(self, policy: torch.nn.Module, parallel: ParallelSteps, *, temperature: float, top_k: int,
                 top_p: float, filter_order: str = "sequential", replay_mode: str = "none",
                 use_glm_forward: bool = False, share_prompt_forward: bool = False,
                 reference: list[torch.nn.Module] | None = None, reference_is_base: bool = False):
        self.policy = policy
        self.parallel = parallel
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.filter_order = filter_order
        self.replay_mode = replay_mode
        self.use_glm_forward = use_glm_forward
        self.share_prompt_forward = share_prompt_forward
        self.reference: list[torch.nn.Module] = reference if reference is not None else []
        self.reference_is_base = reference_is_base

    def forward_logits(self, model: torch.nn.Module, exp: Experience, capture: dict | None = None,
                       replay: bool | None = None) -> torch.Tensor:
        """Logits predicting each response token: [B, T, V]. `replay` (default: whether `model` is the
        policy): with `algo.replay`, the engine's recorded experts / DSA keys replace the model's own
        choices; `capture` receives the choices used."""
        P = exp.prompt_length
        own = model is self.policy if replay is None else replay
        replay = replay_.replay_for(self.replay_mode if own else "none", model, exp, capture)
        if self.use_glm_forward and glm_forward.supports(model):
            return glm_forward.forward_logits(model, exp.input_ids, exp.attention_mask, exp.position_ids,
                                              start=P - 1, replay=replay)[:, :-1]
        shared = self._shared_prompt_forward(model, exp) if replay is None else None
        if shared is not None:  # rows that repeat a prompt: its forward once (glmlight/models/shared_prompt.py)
            return shared()
        keep = {"logits_to_keep": exp.input_ids.shape[1] - P + 1} if takes_logits_to_keep(model) else {}
        with transformers_replay(model, replay):
            out = model(input_ids=exp.input_ids, attention_mask=exp.attention_mask, position_ids=exp.position_ids,
                        use_cache=False, **keep)
        # (with logits_to_keep, the LM head runs on positions P-1.. only: a large vocabulary's logits of the
        # prompt positions would cost as much as a few layers, for nothing)
        return out.logits[:, -(exp.input_ids.shape[1] - P + 1) : -1]

    def forward_logits_mtp(self, model: torch.nn.Module, exp: Experience) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward_logits` of a model with MTP layers (`glmlight.models.mtp`), and each MTP depth d's logits over
        the same responses, [B, T, V]: entry j predicts response token j from position P + j - d - 1
        (`glmlight.ops.mtp.mtp_mask` says which count). The MTP logits' gradient reaches the MTP layers only."""
        P = exp.prompt_length
        replay = replay_.replay_for(self.replay_mode if model is self.policy else "none", model, exp, None)
        if self.use_glm_forward and glm_forward.supports(model):
            logits, mtp = glm_forward.forward_logits_mtp(model, exp.input_ids, exp.attention_mask, exp.position_ids,
                                                         start=P - 1, replay=replay)
        else:
            with transformers_replay(model, replay):
                logits, mtp = hf_forward_logits_mtp(model, exp.input_ids, exp.attention_mask, exp.position_ids,
                                                    start=P - 1)
        return logits[:, :-1], [z[:, :-1] for z in mtp]

    def _shared_prompt_forward(self, model: torch.nn.Module, exp: Experience):
        """`shared_prompt.plan` when `algo.share_prompt_forward` is on and the models are not FSDP-sharded."""
        if not self.share_prompt_forward or self.parallel.sharded:
            return None
        return shared_prompt.plan(model, exp)

    @torch.no_grad()
    def compute_logprobs(self, model: torch.nn.Module, exp: Experience, replay: bool | None = None) -> torch.Tensor:
        """Log-probs [B, T] of the responses under `model` (`replay`: as in `forward_logits`)."""
        return self.parallel.per_row(exp, lambda mb: self.logprobs(self.forward_logits(model, mb, replay=replay),
                                                          mb.response_ids, mb))

    def sampling_of(self, exp: Experience | None) -> tuple:
        """(temperature, top_k, top_p) that `exp`'s response tokens were drawn with: the run's numbers, or
        [B, T] tensors when some were drawn with other settings (`Experience.sampling`; NaN there: the run's)."""
        s = None if exp is None else exp.sampling
        if s is None:
            return self.temperature, self.top_k, self.top_p
        run = torch.tensor([self.temperature, float(self.top_k), self.top_p], device=s.device)
        s = torch.where(s.isnan(), run, s)
        return s[..., 0], s[..., 1].long(), s[..., 2]

    def filters(self, exp: Experience | None = None) -> bool:
        """Whether some of `exp`'s tokens (any token, without `exp`) may be scored with top-k or top-p on."""
        return self.top_k > 0 or self.top_p < 1 or (exp is not None and exp.sampling is not None)

    def logprobs(self, logits: torch.Tensor, labels: torch.Tensor, exp: Experience | None = None) -> torch.Tensor:
        """Log-probs [B, T] of `labels` under the sampling distribution the engine used (`exp`: the batch
        of `labels`, whose per-turn sampling applies; None: the run's). With top-k / top-p a token outside
        the trainer's kept set (its logits differ from the engine's) has probability 0: it gets
        LOGPROB_FLOOR instead of −inf, so ratios stay finite (IcePop pops it, DIS masks it) and no
        gradient flows through it."""
        lp = logprobs_from_logits(logits, labels, *self.sampling_of(exp), self.filter_order)
        return lp.clamp(min=LOGPROB_FLOOR) if self.filters(exp) else lp

    def entropy(self, logits: torch.Tensor, mask: torch.Tensor, with_grad: bool,
                exp: Experience | None = None) -> torch.Tensor:
        """Entropy [B, T] of the sampling distribution on mask positions (0 elsewhere), computed over
        those positions only; without gradient unless `with_grad` (an entropy loss term). `exp`: as in
        `logprobs`."""
        out = logits.new_zeros(mask.shape, dtype=torch.float32)
        keep = mask.bool()
        sampling = self.sampling_of(exp)
        per_token = isinstance(sampling[0], torch.Tensor)

        def args(*index):  # the sampling of the positions `index` selects
            return (*(tuple(x[index] for x in sampling) if per_token else sampling), self.filter_order)

        if with_grad and torch.is_grad_enabled():
            return out.masked_scatter(keep, entropy_from_logits(logits[keep], *args(keep)))
        # Without gradient, a few positions at a time: the vocabulary-wide temporaries of the whole batch
        # (a log-softmax, its exp, ...: 200 MB each for 1024 positions of a 49k vocabulary) cost more in
        # memory traffic and page faults than the arithmetic (3 s against 0.3 s on SmolLM2, one CPU thread).
        rows, cols = keep.nonzero(as_tuple=True)
        step = max(1, ENTROPY_CHUNK_ELEMENTS // logits.shape[-1])
        with torch.no_grad():
            for i in range(0, rows.numel(), step):
                r, c = rows[i : i + step], cols[i : i + step]
                out[r, c] = entropy_from_logits(logits[r, c], *args(r, c))
        return out

    def reference_logprobs(self, batch: Experience) -> torch.Tensor | None:
        """θ_ref's log-probs (algo.kl_coef > 0): a LoRA policy's frozen base, its adapters disabled, or the
        frozen copy of the initial policy; None without a reference."""
        if self.reference_is_base:
            with base_model_context(self.policy):
                return self.compute_logprobs(self.policy, batch, replay=False)  # the base is not the policy
        if self.reference:  # (sharded: where its shards are; else moved to the batch's device)
            ref = self.reference[0] if self.parallel.sharded else self.reference[0].to(batch.input_ids.device)
            return self.compute_logprobs(ref, batch)
        return None
