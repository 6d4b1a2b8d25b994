"""The GLM-5 stage pipeline end to end on the test-size model: Reasoning RL -> Agentic RL ->
General RL -> cross-stage OPD, then resume, skip and a failing stage."""

import csv
import glob
import json
import os

import pytest
import torch
from glmlight.run.pipeline import load_config, run_pipeline, stage_config

from glmlight.errors import ConfigError
from glmlight.models.loading import load_causal_lm, load_tokenizer
from tests.conftest import overrides_for_tests

# Stage 'general' keeps its mixed reward and gains a dense component, so that the stage changes the weights.
DENSE = "{weight: 0.5, reward: {_target_: tests.conftest.digit_fraction_reward}}"


OPD = [o for o in load_config().stages["opd"].overrides
       if not o.startswith(("trainer.max_steps", "rollout.rollout_batch_size"))]


def _config(tmp_path, *extra):
    common = [o for o in overrides_for_tests(tmp_path) if not o.startswith("trainer.default_root_dir")]
    common += ["trainer.max_steps=2", "~callbacks.held_out_eval", "~callbacks.sample_table",
               "rollout.rollout_batch_size=3", "rollout.n_samples_per_prompt=2"]
    return load_config(overrides=[f"pipeline.dir={tmp_path}/pipe", "pipeline.common=" + json.dumps(common),
                                  f"pipeline.stages.general.merge.task.reward.components.digits={DENSE}",
                                  "pipeline.stages.opd.prompts_per_teacher=8",
                                  "pipeline.stages.opd.eval_prompts_per_teacher=2",
                                  # the shipped first stage's multi-task warm start is 300 steps: none here
                                  "pipeline.stages.reasoning.overrides=[algo=grpo,task=arithmetic]",
                                  # the shipped distillation stage without its step count and batch size
                                  "pipeline.stages.opd.overrides=" + json.dumps(OPD), *extra])


def _metrics(run_dir):
    with open(glob.glob(os.path.join(run_dir, "csv", "*", "metrics.csv"))[0]) as f:
        return list(csv.DictReader(f))


def _stages(manifest):
    return {s["name"]: s for s in manifest["stages"]}


def test_pipeline_end_to_end_resume_and_skip(tmp_path, tokenizer):
    cfg = _config(tmp_path)
    assert list(cfg.stages) == ["reasoning", "agentic", "general", "opd"]
    assert stage_config(cfg, "general").task.reward._target_ == "glmlight.rewards.mixed.MixedReward"
    manifest = run_pipeline(cfg)
    stages = _stages(manifest)
    assert [s["status"] for s in manifest["stages"]] == ["completed"] * 4
    # each RL stage starts from the previous one's output, the first from the configured model (which it
    # saves), and the shipped distillation stage from that saved base (start_from: base)
    assert stages["reasoning"]["input_checkpoint"] is None
    for prev, cur in (("reasoning", "agentic"), ("agentic", "general")):
        assert stages[cur]["input_checkpoint"] == stages[prev]["output_checkpoint"]
        assert "model.warm_start.steps=0" in stages[cur]["overrides"]
    assert stages["opd"]["input_checkpoint"] == stages["reasoning"]["initial_checkpoint"]
    assert "model.warm_start.steps=0" in stages["opd"]["overrides"]
    # every later stage starts from its input as it is (the first stage's warm start trained all formats)
    assert all(stages[s]["overrides"].count("model.warm_start.steps=0") == 2 for s in ("agentic", "general", "opd"))
    assert stages["reasoning"]["evaluation"] == {}  # this test runs without the held-out evaluation
    for s in manifest["stages"]:
        assert s["started_at"] <= s["finished_at"] and os.path.isdir(s["output_checkpoint"])
    with open(os.path.join(str(tmp_path), "pipe", "manifest.json")) as f:
        assert json.load(f) == manifest

    # a saved stage loads back as tokenizer + tiny GLM-5 through the model contract
    out = stages["general"]["output_checkpoint"]
    tok = load_tokenizer(out)
    assert tok("7+5=")["input_ids"] == tokenizer("7+5=")["input_ids"] and tok.chat_template == tokenizer.chat_template
    model = load_causal_lm(out, tok)
    assert type(model).__name__ == "GlmMoeDsaForCausalLM"
    first = load_causal_lm(stages["reasoning"]["output_checkpoint"], tok)
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), first.state_dict().values()))

    # cross-stage OPD: one teacher per earlier stage, routed by that stage's domain, over a prompt mix
    teachers = stages["opd"]["teachers"]
    assert {k: v["domains"] for k, v in teachers.items()} == {"reasoning": ["math"], "agentic": ["agent"],
                                                              "general": ["general"]}
    assert all(v["path"] == stages[k]["output_checkpoint"] for k, v in teachers.items())
    with open(os.path.join(stages["opd"]["run_dir"], "prompts.jsonl")) as f:
        domains = [json.loads(line)["domain"] for line in f]
    assert sorted(domains) == ["agent"] * 8 + ["general"] * 8 + ["math"] * 8
    rows = [r for r in _metrics(stages["opd"]["run_dir"]) if r.get("opd/reverse_kl")]
    assert len(rows) == 2
    # the agent stage's prompts run as its episodes (its environment, domain 'agent' only); the others single-turn
    episodes = [r for r in _metrics(stages["opd"]["run_dir"]) if r.get("rollout/tool_calls_per_episode")]
    assert episodes and all(0 < float(r["rollout/turns_per_episode"]) for r in episodes)
    for r in rows:
        assert sum(float(r[f"opd/frac/{t}"]) for t in teachers) == pytest.approx(1.0)

    # resume: completed stages are not rerun
    again = run_pipeline(_config(tmp_path))
    assert _stages(again)["opd"]["finished_at"] == stages["opd"]["finished_at"]
    assert [s["status"] for s in again["stages"]] == ["completed"] * 4

    # skip: the agentic stage is left out; 'general' now starts from 'reasoning' (so it reruns),
    # and the distillation stage has no agent teacher or agent prompts
    skipped = _stages(run_pipeline(_config(tmp_path, "pipeline.skip=[agentic]")))
    assert skipped["agentic"]["status"] == "skipped" and skipped["reasoning"]["finished_at"] == stages["reasoning"]["finished_at"]
    assert skipped["general"]["input_checkpoint"] == stages["reasoning"]["output_checkpoint"]
    assert set(skipped["opd"]["teachers"]) == {"reasoning", "general"}


def test_pipeline_failed_stage_is_recorded_and_resumed(tmp_path):
    cfg = _config(tmp_path, "pipeline.skip=[agentic,general]",
                  'pipeline.stages.opd.overrides=["algo=opd", "algo.lrr=1"]')
    with pytest.raises(ConfigError, match="unknown key 'algo.lrr'"):
        run_pipeline(cfg)
    with open(os.path.join(str(tmp_path), "pipe", "manifest.json")) as f:
        stages = _stages(json.load(f))
    assert stages["reasoning"]["status"] == "completed"
    assert stages["opd"]["status"] == "failed" and "algo.lrr" in stages["opd"]["error"]
    fixed = _stages(run_pipeline(_config(tmp_path, "pipeline.skip=[agentic,general]")))
    assert fixed["reasoning"]["finished_at"] == stages["reasoning"]["finished_at"]  # not rerun
    assert fixed["opd"]["status"] == "completed" and set(fixed["opd"]["teachers"]) == {"reasoning"}


def test_resume_reruns_a_stage_whose_configuration_changed(tmp_path, monkeypatch):
    """A completed stage is kept on resume only when it would run the same way again: changed overrides
    (of the stage or pipeline.common), or a changed teacher set, run it (and so the stages after it) again."""
    import glmlight.run.pipeline as pipeline

    ran, real = [], pipeline.run_stage
    monkeypatch.setattr(pipeline, "run_stage", lambda p, name, *a: ran.append(name) or real(p, name, *a))

    def runs(*extra):
        ran.clear()
        return _stages(run_pipeline(_config(tmp_path, *extra)))

    layout = ["pipeline.skip=[agentic,general]"]
    first = runs(*layout)
    assert ran == ["reasoning", "opd"]
    same = runs(*layout)
    assert ran == []
    assert [same[s]["finished_at"] for s in ("reasoning", "opd")] == [first[s]["finished_at"] for s in ("reasoning", "opd")]
    changed = runs(*layout, "pipeline.stages.opd.prompts_per_teacher=6")
    assert ran == ["opd"]
    assert changed["reasoning"]["finished_at"] == first["reasoning"]["finished_at"]
    with open(os.path.join(changed["opd"]["run_dir"], "prompts.jsonl")) as f:
        assert sum(1 for _ in f) == 6  # the distillation stage ran again, with 6 prompts (was 8)
    # a teacher stage that ran before and is now skipped: the distillation stage has one teacher fewer
    both = runs("pipeline.skip=[agentic]")
    assert ran == ["general", "opd"]
    fewer = runs("pipeline.skip=[agentic,general]")
    assert ran == ["opd"]
    assert set(both["opd"]["teachers"]) == {"reasoning", "general"} and set(fewer["opd"]["teachers"]) == {"reasoning"}


def test_stage_starts_from_the_base_model_or_a_named_stage(tmp_path):
    """`start_from: base`: the distillation student is the warm-started model the first stage began from
    (saved as <dir>/<first>/initial), not the last stage's output; `start_from: <stage>`: that stage's output."""
    layout = ["pipeline.skip=[agentic]", "pipeline.stages.opd.start_from=base",
              "pipeline.stages.general.start_from=reasoning",
              # a warm start of its own, so that the saved base differs from the untouched model
              "pipeline.stages.reasoning.overrides=[algo=grpo,task=arithmetic,model.warm_start.steps=2]"]
    stages = _stages(run_pipeline(_config(tmp_path, *layout)))
    initial = stages["reasoning"]["initial_checkpoint"]
    assert initial == os.path.join(stages["reasoning"]["run_dir"], "initial") and os.path.isdir(initial)
    assert stages["reasoning"]["input_checkpoint"] is None
    assert stages["general"]["input_checkpoint"] == stages["reasoning"]["output_checkpoint"]
    assert stages["opd"]["input_checkpoint"] == initial and "model.warm_start.steps=0" in stages["opd"]["overrides"]
    assert set(stages["opd"]["teachers"]) == {"reasoning", "general"}
    tok = load_tokenizer(initial)
    base, trained = load_causal_lm(initial, tok), load_causal_lm(stages["reasoning"]["output_checkpoint"], tok)
    fresh = load_causal_lm(None, tok, preset="test")
    assert any(not torch.equal(a, b) for a, b in zip(base.state_dict().values(), trained.state_dict().values()))
    assert any(not torch.equal(a, b) for a, b in zip(base.state_dict().values(), fresh.state_dict().values()))
    # resume: nothing reruns, and the base is found again in the manifest
    again = _stages(run_pipeline(_config(tmp_path, *layout)))
    assert [again[s]["finished_at"] for s in ("reasoning", "general", "opd")] == \
        [stages[s]["finished_at"] for s in ("reasoning", "general", "opd")]
    # a base model given to the pipeline is the base
    given = _stages(run_pipeline(_config(tmp_path, f"pipeline.base_model={initial}", "pipeline.dir=" + str(tmp_path / "p2"),
                                         "pipeline.skip=[agentic,general]", "pipeline.stages.opd.start_from=base")))
    assert given["opd"]["input_checkpoint"] == given["reasoning"]["input_checkpoint"] == initial
    assert "initial_checkpoint" not in given["reasoning"]


@pytest.mark.parametrize("override, message", [
    ("pipeline.skip=[nope]", "pipeline.skip names 'nope'"),
    ("pipeline.stages.opd.distill_from=[later]", "distill_from names 'later'"),
    ("pipeline.stages.agentic.start_from=opd", "start_from is 'opd'"),
    ("pipeline.stagez=1", "stagez"),
])
def test_pipeline_config_errors(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        run_pipeline(_config(tmp_path, override))


def test_pipeline_cli_one_line_error(tmp_path):
    import subprocess
    import sys

    from tests.conftest import REPO

    out = subprocess.run([sys.executable, "scripts/pipeline.py", "pipeline.skip=[nope]"], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "pipeline.skip names 'nope'" in out.stderr


def test_stage_summary_keeps_each_domains_pass_rates():
    """The manifest's evaluation of a stage over several domains (cross-stage OPD) has each domain's pass
    rates beside the whole set's, so a student can be read against each teacher on its own domain."""
    from types import SimpleNamespace

    from glmlight.run.pipeline import evaluation_summary

    class HeldOutEval:
        history = [(0, {"eval/heldout/pass@1": 0.5, "eval/heldout/math/pass@1": 0.4, "eval/heldout/pass@8": 0.9,
                        "eval/heldout/math/greedy/pass_rate": 0.3, "eval/heldout/greedy/env/correct": 1.0}),
                   (0, {"eval/teacher/math/heldout/pass@1": 0.8}),
                   (10, {"eval/heldout/pass@1": 0.6, "eval/heldout/math/pass@1": 0.7})]

    out = evaluation_summary(SimpleNamespace(trainer=SimpleNamespace(callbacks=[HeldOutEval()])))
    assert out["first"] == {"rl_step": 0, "heldout/pass@1": 0.5, "heldout/math/pass@1": 0.4,
                            "heldout/math/greedy/pass_rate": 0.3}
    assert out["last"] == {"rl_step": 10, "heldout/pass@1": 0.6, "heldout/math/pass@1": 0.7}
    assert out["teachers"] == {"eval/teacher/math/heldout/pass@1": 0.8}


def test_distillation_evaluates_every_teachers_domain(tmp_path):
    """The distillation stage's held-out set holds `eval_prompts_per_teacher` prompts of every teacher's
    domain, also when they add up to more than the task's `num_eval_prompts` (64 by default): the evaluation
    took the first 64 rows, which left the last teacher's domain out at 32 per teacher."""
    from glmlight.run.build import build_sources
    from glmlight.data.evaluation import EvalSet
    from glmlight.run.pipeline import Manifest, prepare_distillation

    cfg = _config(tmp_path, "pipeline.stages.opd.eval_prompts_per_teacher=30")
    manifest = Manifest(str(tmp_path / "manifest.json"), cfg, fresh=True)
    for name in ("reasoning", "agentic", "general"):
        manifest.update(name, status="completed", output_checkpoint=str(tmp_path / name))
    stage = stage_config(cfg, "opd")
    prepare_distillation(cfg, "opd", stage, manifest, str(tmp_path / "opd"))
    _, held_out = build_sources(stage.task, stage.seed)
    chosen = EvalSet(held_out, stage.task.num_eval_prompts).prompts()  # what the evaluation runs
    assert sorted(p.domain for p in chosen) == ["agent"] * 30 + ["general"] * 30 + ["math"] * 30


@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(os.path.join(os.path.dirname(__file__), "..", "..",
                                                                              "conf", "pipeline")) if f.endswith(".yaml")))
def test_every_shipped_pipeline_composes_with_its_seed(name, tmp_path):
    """`scripts/pipeline.py pipeline=NAME pipeline.seed=N`: every stage of every shipped pipeline composes
    and validates, with the seed in each stage (nothing is loaded or built)."""
    from glmlight.config.schema import validate
    from glmlight.run.pipeline import check_stages, named_config

    p = load_config(named_config(name), [f"pipeline.dir={tmp_path}", "pipeline.seed=3"])
    check_stages(p)
    for stage in p.stages:
        assert validate(stage_config(p, stage)).seed == 3
    with pytest.raises(ConfigError, match=r"pipeline=nope: no such pipeline \(shipped: \[.*'smollm2'"):
        named_config("nope")


def test_smollm2_distillation_routes_and_scores_each_family_by_its_own_rule(tmp_path):
    """The SmolLM2 pipeline's distillation stage: one teacher per expert stage, routed by domain, a prompt mix
    of chat questions from both families, and each answer checked by its family's verifier (ByDomain)."""
    from glmlight.run.build import build_sources
    from glmlight.run.pipeline import Manifest, named_config, prepare_distillation
    from glmlight.rewards import build_reward
    from glmlight.sample import Sample

    p = load_config(named_config("smollm2"), [f"pipeline.dir={tmp_path}"])
    manifest = Manifest(str(tmp_path / "manifest.json"), p, fresh=True)
    for name in ("math", "sort"):
        manifest.update(name, status="completed", output_checkpoint=str(tmp_path / name))
    stage = stage_config(p, "opd")
    teachers = prepare_distillation(p, "opd", stage, manifest, str(tmp_path / "opd"))
    assert {k: v["domains"] for k, v in teachers.items()} == {"math": ["math"], "sort": ["sort"]}
    train, held_out = build_sources(stage.task, stage.seed)
    first = [train[i] for i in range(16)]
    assert {q.domain for q in first} == {"math", "sort"} and all(q.messages[-1]["role"] == "user" for q in first)
    assert sorted(q.domain for q in (held_out[i] for i in range(len(held_out)))) == ["math"] * 32 + ["sort"] * 32
    reward = build_reward(stage.task.reward)

    def score(domain, label, text):
        return reward(Sample(prompt_ids=[1], response_ids=[2], loss_mask=[1], rollout_logprobs=[0.0], versions=[0],
                             metadata={"completion_text": text, "label": label, "domain": domain}))[0]

    assert score("math", "12", "7 + 5 = 12.") == 1.0 and score("math", "12", "12, no: 13") == 0.0
    assert score("sort", "2, 7, 9", "The sorted list is 2, 7, 9.") == 1.0 and score("sort", "2, 7, 9", "9, 7, 2") == 0.0


def test_a_stage_after_the_first_loads_its_input_checkpoint_not_the_configured_package(tmp_path):
    """pipeline=smollm2 names its model by a registry package (model=smollm2: model.gguf.package); a later
    stage's input is a checkpoint directory, which replaces the package rather than clashing with it."""
    from glmlight.models.gguf import resolve_model_path
    from glmlight.run.pipeline import named_config, stage_overrides

    p = load_config(named_config("smollm2"), [f"pipeline.dir={tmp_path}"])
    ckpt = str(tmp_path / "math" / "initial")
    cfg = stage_config(p, "sort", stage_overrides(p, "sort", ckpt, str(tmp_path / "sort")))
    assert resolve_model_path(cfg.model) == ckpt and cfg.model.warm_start.steps == 0
