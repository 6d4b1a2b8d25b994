"""The GLM-5 post-training stages (the stage contract), run in order, each from the previous
stage's checkpoint. `scripts/pipeline.py` is the command line.

Each stage is one `glmlight.build(compose(overrides))` + fit in `<dir>/<stage>/`, after
which its final policy is saved as a Hugging Face checkpoint in `<dir>/<stage>/policy`.
A stage's input is the previous stage's output (`model.path=<dir>`, warm start off unless the
stage sets `warm_start: true`: an agent stage's format warm start on expert episodes), or what its
`start_from` names: `base` (the model the first stage started from) or an earlier stage. The
manifest also records each stage's held-out evaluation at its first and last evaluation.
A distillation stage (`distill_from: [...]`) gets one teacher per listed stage (its final
checkpoint, routed by that stage's `domain`) and a prompt mix of those stages' tasks,
each prompt tagged with its stage's domain. `<dir>/manifest.json` records every stage
(status, input and output checkpoints, timestamps); with `pipeline.resume=true` (the
default) a stage the manifest lists as completed, from the same input and with the same
configuration (`stage_digest`), is not rerun; when a stage runs, the later stages are marked stale
and run again.
Overrides are `pipeline.KEY=VALUE` (values parsed as YAML).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from glmlight.config.compose import CONF_DIR, compose
from glmlight.errors import ConfigError

DEFAULT_CONFIG = os.path.join(CONF_DIR, "pipeline", "glm5.yaml")

log = logging.getLogger("glmlight.run.pipeline")


@dataclass
class StageConfig:
    overrides: list[str] = field(default_factory=list)  # Hydra overrides of conf/train.yaml
    merge: dict[str, Any] = field(default_factory=dict)  # values merged into the composed config (nested dicts)
    domain: Optional[str] = None  # the prompt domain this stage's checkpoint teaches in distillation
    distill_from: list[str] = field(default_factory=list)  # non-empty: cross-stage OPD from these stages
    prompts_per_teacher: int = 512  # distillation: prompts drawn from each teacher stage's task
    eval_prompts_per_teacher: int = 16  # distillation: held-out prompts per teacher stage
    # Keep the stage's own warm start on its input checkpoint (an agent stage's format warm start on the
    # environment's expert episodes); false = the warm start is off for every stage after the first.
    warm_start: bool = False
    # The stage's input: None = the previous stage's output; "base" = the model the first stage started
    # from (pipeline.base_model, or the warm-started configured model, which the first stage then saves as
    # <dir>/<first>/initial); or an earlier stage's name = that stage's output.
    start_from: Optional[str] = None


@dataclass
class PipelineConfig:
    name: str = "glm5"
    dir: str = "runs/pipeline/glm5"
    base_model: Optional[str] = None  # the first stage's input checkpoint; None = the config's own model
    common: list[str] = field(default_factory=list)  # overrides applied to every stage (before its own)
    seed: Optional[int] = None  # every stage's `seed=` (after common); None = the train config's own
    skip: list[str] = field(default_factory=list)
    resume: bool = True
    stages: dict[str, StageConfig] = field(default_factory=dict)


@dataclass
class PipelineFile:
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)


def named_config(name: str) -> str:
    """`pipeline=NAME` on the command line: the shipped conf/pipeline/NAME.yaml."""
    path = os.path.join(CONF_DIR, "pipeline", f"{name}.yaml")
    if not os.path.isfile(path):
        shipped = sorted(f[:-5] for f in os.listdir(os.path.dirname(path)) if f.endswith(".yaml"))
        raise ConfigError(f"config error: pipeline={name}: no such pipeline (shipped: {shipped})")
    return path


def load_config(path: str = DEFAULT_CONFIG, overrides: list[str] = ()) -> PipelineConfig:
    """The typed pipeline config from a YAML file plus `pipeline.KEY=VALUE` overrides."""
    if not os.path.isfile(path):
        raise ConfigError(f"config error: pipeline config {path} does not exist")
    bad = [o for o in overrides if "=" not in o or not o.startswith("pipeline.")]
    if bad:
        raise ConfigError(f"config error: pipeline overrides look like pipeline.KEY=VALUE, got {bad[0]!r}")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(PipelineFile), OmegaConf.load(path),
                              OmegaConf.from_dotlist(list(overrides)))
    except Exception as e:  # noqa: BLE001 - OmegaConf errors: one line naming the key
        key = getattr(e, "full_key", None)
        msg = str(getattr(e, "msg", None) or e).strip().splitlines()[0]
        raise ConfigError(f"config error: {key + ': ' if key else ''}{msg}") from None
    return OmegaConf.to_object(cfg).pipeline


# ---------------------------------------------------------------------------------------------- manifest
def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Manifest:
    """`<dir>/manifest.json`: one entry per stage, in pipeline order, rewritten atomically on every change."""

    def __init__(self, path: str, pipeline: PipelineConfig, fresh: bool):
        self.path = path
        previous: dict[str, Any] = {}
        if not fresh and os.path.exists(path):
            with open(path) as f:
                previous = json.load(f)
        old = {s["name"]: s for s in previous.get("stages", [])}
        self.data = {"pipeline": pipeline.name, "dir": os.path.dirname(path),
                     "created_at": previous.get("created_at") or _now(), "updated_at": None,
                     "stages": [old.get(name, {"name": name, "status": "pending"}) for name in pipeline.stages]}

    def stage(self, name: str) -> dict[str, Any]:
        return next(s for s in self.data["stages"] if s["name"] == name)

    def update(self, name: str, **fields: Any) -> None:
        self.stage(name).update(fields)
        self.data["updated_at"] = _now()
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=2)
        os.replace(tmp, self.path)


# ---------------------------------------------------------------------------------------------- stages
def check_stages(p: PipelineConfig) -> None:
    names = list(p.stages)
    if not names:
        raise ConfigError("config error: pipeline.stages is empty")
    for s in p.skip:
        if s not in p.stages:
            raise ConfigError(f"config error: pipeline.skip names {s!r}, which is not a stage ({names})")
    for i, (name, st) in enumerate(p.stages.items()):
        if st.start_from is not None and st.start_from != "base" and st.start_from not in names[:i]:
            raise ConfigError(f"config error: pipeline.stages.{name}.start_from is {st.start_from!r}: 'base' or an "
                              f"earlier stage ({names[:i]})")
        for src in st.distill_from:
            if src not in names[:i]:
                raise ConfigError(f"config error: pipeline.stages.{name}.distill_from names {src!r}, which is not an "
                                  f"earlier stage ({names[:i]})")


def stage_config(p: PipelineConfig, name: str, extra: list[str] = ()) -> DictConfig:
    """The composed train config of one stage: common + the stage's overrides + `extra`, then `merge`."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    from glmlight.config.schema import format_config_error
    st = p.stages[name]
    try:
        cfg = compose([*common_overrides(p), *st.overrides, *extra])
        OmegaConf.set_struct(cfg, False)
        if st.merge:
            cfg = OmegaConf.merge(cfg, OmegaConf.create(st.merge))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(f"{format_config_error(e)} (pipeline stage {name})") from None
    return cfg


def common_overrides(p: PipelineConfig) -> list[str]:
    """What every stage gets before its own overrides: pipeline.common, then pipeline.seed."""
    return [*p.common, *([] if p.seed is None else [f"seed={p.seed}"])]


def run_pipeline(p: PipelineConfig) -> dict[str, Any]:
    """Run (or resume) every stage in order; return the manifest."""
    check_stages(p)
    root = os.path.abspath(p.dir)
    os.makedirs(root, exist_ok=True)
    manifest = Manifest(os.path.join(root, "manifest.json"), p, fresh=not p.resume)
    base = os.path.abspath(p.base_model) if p.base_model else None
    current = base
    for name in p.stages:
        entry = manifest.stage(name)
        if name in p.skip:
            manifest.update(name, status="skipped", skipped_at=_now())
            log.info("stage %s: skipped", name)
            continue
        if p.stages[name].start_from is not None:
            current = stage_input(p, name, manifest, base)
        if (p.resume and entry.get("status") == "completed" and entry.get("input_checkpoint") == current
                and os.path.isdir(entry.get("output_checkpoint") or "")):
            if entry.get("config") == stage_digest(p, name):
                log.info("stage %s: completed earlier (%s), not rerun", name, entry["output_checkpoint"])
                current = entry["output_checkpoint"]
                continue
            log.info("stage %s: completed earlier with another configuration: run again", name)
        current = run_stage(p, name, current, manifest, root)
    return manifest.data


def stage_digest(p: PipelineConfig, name: str) -> str:
    """What a stage runs with, as a digest: pipeline.common, the stage's own settings and the teacher
    stages it gets (those not skipped). A completed stage whose digest changed runs again on resume."""
    st = p.stages[name]
    blob = json.dumps({"common": common_overrides(p), "stage": asdict(st),
                       "teachers": [s for s in st.distill_from if s not in p.skip]}, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def stage_input(p: PipelineConfig, name: str, manifest: Manifest, base: str | None) -> str:
    """The checkpoint a stage with `start_from` begins with: an earlier stage's output or the base model."""
    src = p.stages[name].start_from
    if src != "base":
        entry = manifest.stage(src)
        if entry.get("status") != "completed" or src in p.skip:
            raise ConfigError(f"config error: stage {name} starts from stage {src}, which has no final checkpoint "
                              f"(status {entry.get('status')})")
        return entry["output_checkpoint"]
    if base is not None:
        return base
    initial = next((manifest.stage(n).get("initial_checkpoint") for n in p.stages if n not in p.skip), None)
    if not initial or not os.path.isdir(initial):
        raise ConfigError(f"config error: stage {name} starts from the base model, which the first stage saves "
                          "when it runs from the configured model; run it (pipeline.resume=false) or set "
                          "pipeline.base_model")
    return initial


def stage_overrides(p: PipelineConfig, name: str, input_ckpt: str | None, run_dir: str) -> list[str]:
    """What the pipeline adds to a stage's own overrides: its directory and name, and its input checkpoint
    (which replaces the configured model, a registry package's GGUF included), warm start off unless the
    stage keeps it."""
    extra = [f"trainer.default_root_dir={run_dir}", f"run_name={p.name}-{name}"]
    if input_ckpt:
        extra += [f"model.path={input_ckpt}", "model.gguf.package=null", "model.gguf.file=null"]
        extra += [] if p.stages[name].warm_start else ["model.warm_start.steps=0"]
    return extra


def run_stage(p: PipelineConfig, name: str, input_ckpt: str | None, manifest: Manifest, root: str) -> str:
    """Build, fit and save one stage; record it in the manifest. Returns the output checkpoint."""
    from glmlight.run.build import build
    from glmlight.models.loading import save_checkpoint

    st = p.stages[name]
    run_dir = os.path.join(root, name)
    output = os.path.join(run_dir, "policy")
    extra = stage_overrides(p, name, input_ckpt, run_dir)
    previous = manifest.stage(name)
    if (previous.get("status") in ("running", "failed") and previous.get("input_checkpoint") == input_ckpt
            and os.path.exists(os.path.join(run_dir, "checkpoints", "last.ckpt"))):
        extra.append("trainer.resume=last")  # continue the interrupted fit
    later = list(p.stages)[list(p.stages).index(name) + 1 :]
    for after in later:  # their input is about to change: a resume must run them again
        if manifest.stage(after).get("status") == "completed":
            manifest.update(after, status="stale")
    manifest.update(name, status="running", input_checkpoint=input_ckpt, output_checkpoint=None, run_dir=run_dir,
                    domain=st.domain, overrides=[*common_overrides(p), *st.overrides, *extra],
                    config=stage_digest(p, name),
                    started_at=_now(), finished_at=None, seconds=None, error=None)
    t0 = time.time()
    log.info("stage %s: starting from %s", name, input_ckpt or "the configured model")
    try:
        cfg = stage_config(p, name, extra)
        if st.distill_from:
            teachers = prepare_distillation(p, name, cfg, manifest, run_dir)
            manifest.update(name, teachers=teachers)
        run = build(cfg)
        if input_ckpt is None and any(s.start_from == "base" for n, s in p.stages.items() if n not in p.skip):
            initial = os.path.join(run_dir, "initial")  # the configured model, warm-started: a later stage's input
            save_checkpoint(run.module.policy, run.datamodule.tokenizer, initial)
            manifest.update(name, initial_checkpoint=initial)
        run.fit()
        save_checkpoint(run.module.policy, run.datamodule.tokenizer, output)
        run.datamodule.engine.close()
        manifest.update(name, evaluation=evaluation_summary(run))
    except BaseException as e:
        manifest.update(name, status="failed", finished_at=_now(), seconds=round(time.time() - t0, 2),
                        error=f"{type(e).__name__}: {e}")
        raise
    manifest.update(name, status="completed", output_checkpoint=output, finished_at=_now(),
                    seconds=round(time.time() - t0, 2))
    log.info("stage %s: completed in %.1fs -> %s", name, time.time() - t0, output)
    return output


def evaluation_summary(run: Any) -> dict[str, Any]:
    """The held-out evaluation at the stage's first and last evaluated RL steps (headline metrics:
    pass rates, reward, tool calls, compactions; each domain's pass rates for a set of several domains),
    and the teachers' where the stage evaluated them."""
    history = next((cb.history for cb in run.trainer.callbacks if type(cb).__name__ == "HeldOutEval"), [])
    keep = ("pass@1", "greedy/pass_rate", "reward", "tool_calls_per_episode", "compactions_per_episode")

    def wanted(name: str) -> bool:  # <set>/<metric> or, for a set of several domains, <set>/<domain>/<metric>
        rest = name.split("/", 1)[-1]
        return rest in keep or (rest.split("/", 1)[-1] in keep and not rest.startswith(("greedy/", "env/")))

    def pick(metrics: dict[str, float], prefix: str) -> dict[str, float]:
        return {k[len(prefix):]: round(v, 4) for k, v in metrics.items()
                if k.startswith(prefix) and wanted(k[len(prefix):]) and "/teacher/" not in k}

    student = [(step, m) for step, m in history if not any(k.startswith("eval/teacher/") for k in m)]
    out: dict[str, Any] = {}
    if student:
        out["first"] = {"rl_step": student[0][0], **pick(student[0][1], "eval/")}
        out["last"] = {"rl_step": student[-1][0], **pick(student[-1][1], "eval/")}
    teachers = {k: round(v, 4) for _, m in history for k, v in m.items()
                if k.startswith("eval/teacher/") and k.rsplit("/", 1)[-1] in ("pass@1", "pass_rate")}
    if teachers:
        out["teachers"] = teachers
    return out


def prepare_distillation(p: PipelineConfig, name: str, cfg: DictConfig, manifest: Manifest,
                         run_dir: str) -> dict[str, Any]:
    """Cross-stage OPD: one teacher per completed `distill_from` stage (routed by its domain), and a
    prompt mix of those stages' tasks written to `<run_dir>/prompts.jsonl`. Edits `cfg`; returns the teachers."""
    from glmlight.run.build import build_sources
    st = p.stages[name]
    teachers: dict[str, Any] = {}
    agent: dict[str, Any] = {"env": None}  # an agent stage's prompts run as its episodes (task.agent.domains)
    train_rows: list[dict[str, Any]] = []
    eval_rows: list[dict[str, Any]] = []
    for src in st.distill_from:
        entry = manifest.stage(src)
        if src in p.skip or entry.get("status") != "completed":
            log.warning("stage %s: %s has no final checkpoint (status %s); no teacher or prompts from it",
                        name, src, entry.get("status"))
            continue
        domain = p.stages[src].domain or src
        teachers[src] = {"path": entry["output_checkpoint"], "domains": [domain]}
        src_cfg = stage_config(p, src)
        if src_cfg.task.agent.env is not None:
            if agent["env"] is not None:
                raise ConfigError(f"config error: stage {name}: distill_from has more than one agent stage "
                                  f"({agent['domains'][0]} and {domain}); one environment per distillation stage")
            agent = {**OmegaConf.to_container(src_cfg.task.agent, resolve=True), "domains": [domain]}
        train, held_out = build_sources(src_cfg.task, src_cfg.seed)
        train_rows += _rows(train, st.prompts_per_teacher, domain)
        if held_out is not None:
            eval_rows += _rows(held_out, st.eval_prompts_per_teacher, domain)
    if not teachers:
        raise ConfigError(f"config error: stage {name}: none of distill_from {st.distill_from} has a completed "
                          "checkpoint to distill from")
    random.Random(0).shuffle(train_rows)
    os.makedirs(run_dir, exist_ok=True)
    task = {"name": f"{name}_mix", "source": "jsonl", "path": _write_jsonl(os.path.join(run_dir, "prompts.jsonl"), train_rows),
            "eval_path": _write_jsonl(os.path.join(run_dir, "eval_prompts.jsonl"), eval_rows) if eval_rows else None,
            "num_eval_prompts": len(eval_rows),  # every teacher's domain (the evaluation takes the first N rows)
            "agent": agent}
    cfg.task = OmegaConf.merge(cfg.task, task)
    cfg.algo.teachers = teachers
    cfg.algo.default_teacher = None
    return teachers


def _rows(source: Any, n: int, domain: str) -> list[dict[str, Any]]:
    rows = []
    for i in range(min(n, len(source))):
        prompt = source[i]
        rows.append({**prompt.metadata, "prompt": prompt.messages, "label": prompt.label, "domain": domain})
    return rows


def _write_jsonl(path: str, rows: list[dict[str, Any]]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(row, default=str) + "\n" for row in rows)
    return path
