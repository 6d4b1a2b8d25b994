"""The teachers of on-policy distillation: the one home of a teacher's config (`TeacherConfig`,
an entry of `algo.teachers`), its checks and routing table (`parse_teachers`, `check_teachers`)
and the two kinds a loaded teacher is — a frozen model scored in the trainer (`ModelTeacher`) or
any engine that scores prefills (`EngineTeacher`). `glmlight.algorithms.opd.OPD` loads and uses them.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch
from omegaconf import OmegaConf

from glmlight.algorithms.parallel import ParallelSteps
from glmlight.algorithms.scoring import PolicyScoring
from glmlight.config.schema import typed_entry, WarmStartConfig
from glmlight.engines.base import can_score_at_temperature
from glmlight.errors import ConfigError, EngineError
from glmlight.ops.logprobs import logprobs_from_logits
from glmlight.sample import Experience


class Student(Protocol):
    """What a teacher uses of the module it teaches (OPD): where the student's tensors live, its
    row-wise batching and forward, and the temperature the teacher's log-probs are taken at."""

    device: torch.device
    teacher_temperature: float
    parallel: ParallelSteps  # the row-wise batching (`per_row`)
    scoring: PolicyScoring  # the forward (`forward_logits`)


@dataclass
class TeacherConfig:
    """One teacher: `path`, `engine`, or neither (the built-in tiny GLM-5), and the domains it teaches."""

    path: Optional[str] = None  # a local Hugging Face checkpoint (safetensors)
    serve: str = "trainer"  # with path: trainer (frozen model in this process) | engine (embedded LocalEngine)
    engine: Optional[dict[str, Any]] = None  # a RolloutEngine with _target_; its score() is the prefill
    domains: list[str] = field(default_factory=list)  # sample.metadata["domain"] values routed here
    dtype: str = "float32"
    # The built-in teacher (neither path nor engine): tiny GLM-5 preset, init seed, warm start on the task.
    preset: str = "tiny"
    seed: int = 0
    warm_start: WarmStartConfig = field(default_factory=lambda: WarmStartConfig(steps=0))  # none unless given


class ModelTeacher:
    """A frozen causal LM evaluated on the trainer side (prefill of the padded batch)."""

    def __init__(self, name: str, model: torch.nn.Module):
        self.name = name
        self.model = model.eval()
        self.model.requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, module: Student, exp: Experience) -> torch.Tensor:
        if next(self.model.parameters()).device != module.device:
            self.model.to(module.device)
        # the policy's micro-batches (algo.micro_batch_size or the token budget); the teacher's own routing
        return module.parallel.per_row(exp, lambda mb: logprobs_from_logits(
            module.scoring.forward_logits(self.model, mb, replay=False), mb.response_ids, module.teacher_temperature))

    def close(self) -> None:
        self.model = None


class EngineTeacher:
    """A teacher behind any RolloutEngine: log-probs from `engine.score(prompts, completions)` (at
    the teacher temperature when the engine's score takes one; servers score at T = 1)."""

    def __init__(self, name: str, engine: Any, temperature: float = 1.0):
        score = getattr(engine, "score", None)
        if not callable(score):
            raise ConfigError(f"config error: algo.teachers.{name}.engine: {type(engine).__name__} has no score() method")
        self.takes_temperature = can_score_at_temperature(engine)
        if temperature != 1.0 and not self.takes_temperature:
            raise ConfigError(f"config error: algo.teachers.{name}: {type(engine).__name__}.score() scores at "
                              f"temperature 1 only, but the teacher temperature is {temperature:g} (the rollout "
                              "temperature); set algo.teacher_temperature=1.0 to distil from the untempered teacher")
        self.name = name
        self.engine = engine
        self.temperature = temperature

    def logprobs(self, module: Student, exp: Experience) -> torch.Tensor:
        prompts = [list(s.prompt_ids) for s in exp.samples]
        completions = [list(s.response_ids) for s in exp.samples]
        kwargs = {"temperature": self.temperature} if self.takes_temperature else {}
        rows = self.engine.score(prompts, completions, **kwargs)
        if len(rows) != len(completions):
            raise EngineError(f"teacher {self.name!r}: engine scored {len(rows)} sequences, expected {len(completions)}")
        out = torch.zeros(exp.batch_size, exp.response_length, dtype=torch.float32)
        for i, (row, comp) in enumerate(zip(rows, completions)):
            if len(row) != len(comp):
                raise EngineError(f"teacher {self.name!r}: engine returned {len(row)} log-probs for a completion of "
                                  f"{len(comp)} tokens (rollout_id={exp.samples[i].rollout_id})")
            if not all(math.isfinite(v) for v in row):
                raise EngineError(f"teacher {self.name!r}: engine returned a non-finite log-prob "
                                  f"(rollout_id={exp.samples[i].rollout_id})")
            if row:
                out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
        return out.to(module.device)

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()


# ---------------------------------------------------------------------------------------------- config checks
def parse_teachers(specs: Any) -> dict[str, TeacherConfig]:
    """`algo.teachers` entries as typed TeacherConfig; a wrong key or type names the key."""
    out = {}
    for name, spec in (specs or {}).items():
        where = f"algo.teachers.{name}"
        if spec is None:
            continue
        tc = OmegaConf.to_object(typed_entry(TeacherConfig, spec, where))
        tc.domains = [str(d) for d in tc.domains]
        out[str(name)] = tc
    return out


def check_teachers(teachers: dict[str, TeacherConfig], default: str | None) -> tuple[dict[str, str], str | None]:
    """Check the teachers; return (domain → teacher name, default teacher or None)."""
    if not teachers:
        raise ConfigError("config error: algo.teachers is empty; OPD needs at least one teacher")
    routes: dict[str, str] = {}
    for name, tc in teachers.items():
        where = f"algo.teachers.{name}"
        if tc.path is not None and tc.engine is not None:
            raise ConfigError(f"config error: {where}: give path or engine, not both")
        if tc.serve not in ("trainer", "engine"):
            raise ConfigError(f"config error: {where}.serve={tc.serve!r} is not one of ['trainer', 'engine']")
        if tc.engine is not None and "_target_" not in tc.engine:
            raise ConfigError(f"config error: {where}.engine needs a _target_ (a RolloutEngine class)")
        for d in tc.domains:
            if d in routes:
                raise ConfigError(f"config error: domain {d!r} is listed by both teachers {routes[d]!r} and {name!r}; "
                                  "each sample goes to exactly one teacher")
            routes[d] = name
    if default is not None and default not in teachers:
        raise ConfigError(f"config error: algo.default_teacher={default!r} is not a teacher ({sorted(teachers)})")
    if default is None and len(teachers) == 1:
        (only,) = teachers
        default = only if not teachers[only].domains else None
    for name, tc in teachers.items():
        if not tc.domains and name != default:
            raise ConfigError(f"config error: algo.teachers.{name} lists no domains and is not algo.default_teacher, "
                              "so no sample would reach it")
    return routes, default


def describe_source(source: Any) -> dict[str, Any]:
    """What identifies a prompt source for the built-in teacher's warm-start cache key."""
    desc: dict[str, Any] = {"type": type(source).__name__, "len": len(source)}
    desc.update({k: v for k, v in vars(source).items() if isinstance(v, (str, int, float, bool, type(None)))})
    head = [source[i].messages for i in range(min(4, len(source)))]
    desc["head"] = hashlib.sha1(json.dumps(head, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return desc
