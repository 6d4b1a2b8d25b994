"""On-policy distillation (OPD): single-teacher, multi-teacher (MOPD) and cross-stage.

The student samples (the RolloutDataModule does that); each sample is routed to
exactly one teacher by `sample.metadata["domain"]`, and that teacher scores the
student's own tokens by prefill (never by generating). The per-token advantage is

    Â_t = sg(log π_teacher(y_t) − log π_student(y_t))   (+ α·Â_ORM, optional)

with log π_student the train-side old log-prob (formulas: glmlight/ops/distill.py).
The policy loss is RLModule's (PPO clip or DIS), so every callback (IcePop, TIS,
monitors) applies unchanged.

A teacher is one of:

- `path`: a local Hugging Face checkpoint, a frozen model evaluated in the trainer
  (`serve: trainer`, the default) or served by an embedded LocalEngine (`serve: engine`);
- `engine`: a RolloutEngine spec (`_target_`, e.g. the SGLang or vLLM client) whose
  `score(prompts, completions)` returns the prefill log-probs;
- neither: the built-in tiny GLM-5 (`preset`, `seed`), warm-started on the run's own
  task for `warm_start.steps` (cached), so a run needs nothing else.

Teachers are never registered submodules: they are not trained, not checkpointed,
and are loaded when fitting starts (`setup`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from hydra.utils import instantiate

from glmlight.algorithms.base import RLModule
from glmlight.algorithms.teachers import (
    EngineTeacher, ModelTeacher, TeacherConfig, check_teachers, describe_source, parse_teachers)
from glmlight.config.schema import AlgoConfig
from glmlight.errors import ConfigError, DataError
from glmlight.hooks import EvalTarget
from glmlight.models.loading import load_causal_lm
from glmlight.models.warm_start import supervised_warm_start
from glmlight.ops.advantages import group_advantages
from glmlight.ops.distill import full_reverse_kl, mix_outcome_advantages, opd_advantages, reverse_kl
from glmlight.ops.reduce import aggregate_loss
from glmlight.ops.reduce import masked_mean
from glmlight.config.ranges import ranges
from glmlight.config.registry import register_algorithm
from glmlight.sample import Experience, Sample

log = logging.getLogger(__name__)


@dataclass
class OPDConfig(AlgoConfig):
    name: str = "opd"
    # name -> TeacherConfig fields (checked when the module is built; a plain dict so that
    # `+algo.teachers.NAME={path: ..., domains: [...]}` can add one from the command line)
    teachers: dict[str, Any] = field(default_factory=dict)
    default_teacher: Optional[str] = None  # serves domains no teacher lists; None = unknown domains are an error
    opd_coef: float = 1.0  # scale of the reverse-KL advantage
    # The temperature of the teachers' log-probs; None = the rollout temperature, the student's (both
    # sides then score the same tempered distribution; top-k / top-p apply to the student's sampling only).
    teacher_temperature: Optional[float] = None
    # How the teacher's judgement enters the loss: "sampled" = GLM-5 Eq. 2, the per-token advantage
    # opd_coef·(log π_T − log π_S) of the sampled token through the policy loss; "full" = the exact reverse KL
    # over the whole vocabulary at every action position (ops.distill.full_reverse_kl, GKD), opd_coef times
    # it added to the loss: no sampling noise per token. "full" needs trainer-side teachers (their logits).
    distill_loss: str = field(default="sampled", metadata={"choices": ("sampled", "full")})
    orm_coef: float = 0.0  # α: add α·(group-normalised outcome advantage); a group of one keeps its raw R
    orm_normalize_std: bool = True  # outcome advantage: GRPO (true) or Dr.GRPO (false)


ranges(OPDConfig, opd_coef=">= 0", orm_coef=">= 0", teacher_temperature="> 0")


# ---------------------------------------------------------------------------------------------- module
@register_algorithm("opd", OPDConfig)
class OPD(RLModule):
    cfg: OPDConfig
    advantages_read_old_logprobs = True  # the distillation advantage is teacher − student log-probs

    def __init__(self, cfg: OPDConfig, policy: torch.nn.Module, **kwargs: Any):
        super().__init__(cfg, policy, **kwargs)
        self.teacher_cfgs = parse_teachers(cfg.teachers)
        self.routes, self.default_teacher = check_teachers(self.teacher_cfgs, cfg.default_teacher)
        # A plain dict of plain objects: never a registered submodule, never checkpointed.
        self._teachers: dict[str, Any] | None = None
        self._noted_group_size = False
        self.teacher_temperature = (cfg.teacher_temperature if cfg.teacher_temperature is not None
                                    else self.scoring.temperature)
        if self.teacher_temperature <= 0:
            raise ConfigError(f"config error: algo.teacher_temperature={self.teacher_temperature:g} must be > 0")
        if cfg.distill_loss == "full":
            if self.scoring.top_k > 0 or self.scoring.top_p < 1:
                raise ConfigError("config error: algo.distill_loss=full compares whole distributions; it needs "
                                  "rollout.top_k=0 and rollout.top_p=1 (use distill_loss=sampled with top-k / top-p)")
            remote = [n for n, tc in self.teacher_cfgs.items() if tc.engine is not None or tc.serve == "engine"]
            if remote:
                raise ConfigError(f"config error: algo.distill_loss=full needs every teacher's logits in the trainer; "
                                  f"algo.teachers.{remote[0]} is served by an engine (serve: trainer, or "
                                  "distill_loss=sampled)")

    # ----------------------------------------------------------------- teachers
    def setup(self, stage: str) -> None:
        self.teachers()

    def teardown(self, stage: str) -> None:
        for t in (self._teachers or {}).values():
            t.close()
        self._teachers = None

    def evaluation_targets(self) -> list[EvalTarget]:
        """Each teacher, evaluated as the student is on the held-out prompts routed to it: through its own
        engine, or an embedded engine around its model in the student engine's dtype and device. Logged as
        `eval/teacher/<set>/*` (one teacher) or `eval/teacher/<name>/<set>/*`."""
        teachers = self.teachers()
        student = self.trainer.datamodule.engine if self._trainer is not None else None
        out = []
        for name, teacher in teachers.items():
            prefix = "eval/teacher" if len(teachers) == 1 else f"eval/teacher/{name}"
            routed = lambda p, name=name: self.routes.get(p.domain, self.default_teacher) == name  # noqa: E731
            engine = getattr(teacher, "engine", None)
            if engine is not None and callable(getattr(engine, "generate", None)):
                out.append(EvalTarget(prefix, engine, routed))
                continue
            from glmlight.engines.local.engine import LocalEngine

            engine = LocalEngine(teacher.model, dtype=getattr(student, "dtype", "float32"),
                                 device=getattr(student, "device", "cpu"), pad_token_id=self.pad_token_id)
            out.append(EvalTarget(prefix, engine, routed, close=engine.close))
        return out

    def teachers(self) -> dict[str, Any]:
        """Load every teacher once (checkpoint, engine or built-in warm start)."""
        if self._teachers is None:
            self._teachers = {name: self._load_teacher(name, tc) for name, tc in self.teacher_cfgs.items()}
        return self._teachers

    def _load_teacher(self, name: str, tc: TeacherConfig) -> Any:
        where = f"algo.teachers.{name}"
        if tc.engine is not None:
            try:
                engine = instantiate(tc.engine, _convert_="all")
            except Exception as e:  # noqa: BLE001
                raise ConfigError(f"config error: {where}.engine: cannot build {tc.engine['_target_']} ({e})") from None
            return EngineTeacher(name, engine, self.teacher_temperature)
        if tc.path is not None:
            model = load_causal_lm(tc.path, None, dtype=tc.dtype, key=f"{where}.path")
        else:
            model = self._builtin_teacher(name, tc)
        self._check_vocab(name, model)
        if tc.serve == "engine":
            from glmlight.engines.local.engine import LocalEngine

            return EngineTeacher(name, LocalEngine(model, dtype=tc.dtype, device=self._target_device(),
                                                   pad_token_id=self.pad_token_id), self.teacher_temperature)
        return ModelTeacher(name, model)

    def _target_device(self) -> torch.device:
        """Where training runs (during `setup` the module may not have been moved there yet)."""
        return self.trainer.strategy.root_device if self._trainer is not None else self.device

    def _builtin_teacher(self, name: str, tc: TeacherConfig) -> torch.nn.Module:
        dm = self.trainer.datamodule if self._trainer is not None else None
        if dm is None or not hasattr(dm, "tokenizer"):
            raise ConfigError(f"config error: algo.teachers.{name} has neither path nor engine; the built-in teacher "
                              "is warm-started on the run's task and needs the run's data module")
        model = load_causal_lm(None, dm.tokenizer, preset=tc.preset, dtype=tc.dtype, seed=tc.seed,
                               key=f"algo.teachers.{name}.path")
        model.to(self._target_device())
        if tc.warm_start.steps > 0:
            supervised_warm_start(model, dm.tokenizer, dm.source, tc.warm_start,
                                  {"opd_teacher": True, "source": describe_source(dm.source)})
        return model

    def _check_vocab(self, name: str, model: torch.nn.Module) -> None:
        mine = self.policy.get_input_embeddings().num_embeddings
        theirs = model.get_input_embeddings().num_embeddings
        if mine != theirs:
            raise ConfigError(f"config error: algo.teachers.{name}: teacher vocabulary has {theirs} entries, the "
                              f"student's {mine}; a teacher must score the student's token ids")

    def route(self, samples: list[Sample]) -> list[str]:
        """The one teacher of each sample, by `metadata["domain"]` (never an average of teachers)."""
        names = []
        for s in samples:
            domain = s.metadata.get("domain")
            name = self.routes.get(domain, self.default_teacher)
            if name is None:
                raise DataError(f"sample {s.rollout_id} has domain {domain!r}, which no teacher covers (known domains: "
                                f"{sorted(self.routes)}); add it to a teacher's domains or set algo.default_teacher")
            names.append(name)
        return names

    def teacher_logprobs(self, batch: Experience, names: list[str]) -> torch.Tensor:
        """Prefill log-probs [B, T] of the sampled tokens, each row from its routed teacher, batched per teacher."""
        teachers = self.teachers()
        out = torch.zeros(batch.batch_size, batch.response_length, dtype=torch.float32, device=self.device)
        for name in dict.fromkeys(names):
            rows = [i for i, n in enumerate(names) if n == name]
            lp = teachers[name].logprobs(self, batch.select(rows))
            out[torch.tensor(rows, device=self.device)] = lp.to(out)
        return out * batch.response_mask.to(out)  # 0 past each response, as engines return it

    # ----------------------------------------------------------------- the step
    def prepare_experience(self, batch: Experience) -> None:
        super().prepare_experience(batch)
        names = self.route(batch.samples)
        self._note_group_size(batch)
        t0 = time.perf_counter()
        batch.teacher_logprobs = self.teacher_logprobs(batch, names)
        batch.stats["opd/teacher_seconds"] = time.perf_counter() - t0
        mask = batch.loss_mask
        batch.stats["opd/reverse_kl"] = reverse_kl(batch.old_logprobs, batch.teacher_logprobs, mask).item()
        for name in self.teacher_cfgs:
            rows = torch.tensor([i for i, n in enumerate(names) if n == name], dtype=torch.long, device=mask.device)
            batch.stats[f"opd/frac/{name}"] = len(rows) / max(len(names), 1)
            if len(rows):
                batch.stats[f"opd/reverse_kl/{name}"] = reverse_kl(batch.old_logprobs[rows], batch.teacher_logprobs[rows],
                                                                   mask[rows]).item()

    def _note_group_size(self, batch: Experience) -> None:
        if self._noted_group_size or self.cfg.orm_coef:
            return
        self._noted_group_size = True
        size = max(Counter(s.group_id for s in batch.samples).values())
        if size > 1:
            log.info("OPD with %d samples per prompt and orm_coef=0: each is distilled on its own; GLM-5 uses one "
                     "(rollout.n_samples_per_prompt=1)", size)

    def compute_advantages(self, batch: Experience) -> None:
        if batch.teacher_logprobs is None:
            raise RuntimeError("OPD.compute_advantages needs teacher log-probs (run prepare_experience first)")
        adv = opd_advantages(batch.teacher_logprobs, batch.old_logprobs, batch.loss_mask, self.cfg.opd_coef)
        if self.cfg.distill_loss == "full":  # the teacher enters through extra_loss; advantages: the outcome term only
            adv = torch.zeros_like(adv)
        batch.stats["opd/advantage_abs_mean"] = masked_mean(adv.abs(), batch.loss_mask).item()
        if self.cfg.orm_coef:
            group_ids = torch.tensor([s.group_id for s in batch.samples])
            # A group of one (GLM-5's OPD group size) has no baseline: its raw reward is the outcome term
            # (verl's convention, mean 0 and std 1); centring would make the term silently 0.
            orm = group_advantages(batch.rewards.cpu(), group_ids, normalize_std=self.cfg.orm_normalize_std,
                                   singleton="raw")
            adv = mix_outcome_advantages(adv, orm.to(adv.device), batch.loss_mask, self.cfg.orm_coef)
            batch.stats["opd/orm_advantage_abs_mean"] = orm.abs().mean().item()
        batch.advantages = adv
        batch.stats["train/advantage_abs_mean"] = masked_mean(adv.abs(), batch.loss_mask).item()

    def extra_loss(self, mb: Experience, logits: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor,
                   scale: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """distill_loss=full: opd_coef · the exact reverse KL to each row's teacher at every action position,
        aggregated as the policy loss is (algo.loss_agg over the whole minibatch)."""
        if self.cfg.distill_loss != "full":
            return super().extra_loss(mb, logits, logprobs, mask, scale)
        teachers, names = self.teachers(), self.route(mb.samples)
        kl = logits.new_zeros(mask.shape, dtype=torch.float32)
        for name in dict.fromkeys(names):
            rows = torch.tensor([i for i, n in enumerate(names) if n == name], device=logits.device)
            teacher = teachers[name].model
            if next(teacher.parameters()).device != logits.device:
                teacher.to(logits.device)
            with torch.no_grad():
                t_logits = self.scoring.forward_logits(teacher, mb.select(rows.tolist()), replay=False)
            kl = kl.index_put((rows,), full_reverse_kl(logits[rows], t_logits, mask[rows], self.scoring.temperature,
                                                       self.teacher_temperature))
        cfg = self.cfg
        loss = aggregate_loss(kl, mask, cfg.loss_agg, constant=cfg.loss_agg_constant or self.max_new_tokens,
                              num_sequences=scale["num_sequences"], total_tokens=scale["total_tokens"],
                              num_rows=scale.get("num_rows"))
        return cfg.opd_coef * loss, {"opd/full_reverse_kl": masked_mean(kl.detach(), mask)}
