"""What token in, token out is checked with: every action turn an RL step trains on (`TrainedIds`; with its
log-probs and versions: `TrainedActions`) and every token sequence the engine returned (`record_generations`;
with log-probs and versions: `record_answers`); a few train.py steps of an agent program through the agent
gateway, checked with them (`gateway_train_steps`)."""

from __future__ import annotations

from glmlight.callbacks.retokenization import action_turns
from glmlight.hooks import RLCallback


class TrainedIds(RLCallback):
    """Per sample of every step: its action turns, and whether the collated row the loss sees holds exactly
    the sample's prompt and response ids."""

    reads_old_logprobs = False

    def __init__(self):
        self.turns, self.rows = [], []

    def on_experience(self, trainer, module, batch):
        for i, s in enumerate(batch.samples):
            self.turns += action_turns(s)
            start = len(s.prompt_ids)
            row = batch.input_ids[i][batch.attention_mask[i].bool()].tolist()
            self.rows.append(row[start:start + len(s.response_ids)] == s.response_ids and row[:start] == s.prompt_ids)


def record_generations(engine) -> list[tuple[int, ...]]:
    """Wrap `engine.generate` so that every answer's token ids are appended to the returned list."""
    produced: list[tuple[int, ...]] = []
    generate = engine.generate

    def recording(prompts, params):
        gens = generate(prompts, params)
        produced.extend(tuple(g.token_ids) for g in gens)
        return gens

    engine.generate = recording
    return produced


class TrainedActions(RLCallback):
    """Every action turn the steps train on: (ids, log-probs, versions), as the batch's samples hold them."""

    reads_old_logprobs = False

    def __init__(self):
        self.turns = []

    def on_experience(self, trainer, module, batch):
        for s in batch.samples:
            run = None
            for tok, lp, v, m in zip(s.response_ids, s.rollout_logprobs, s.versions, s.loss_mask):
                if m:
                    run = run or ([], [], [])
                    for field, x in zip(run, (tok, lp, v)):
                        field.append(x)
                elif run:
                    self.turns.append(tuple(map(tuple, run)))
                    run = None
            if run:
                self.turns.append(tuple(map(tuple, run)))


def record_answers(engine) -> set[tuple[tuple, tuple, tuple]]:
    """Wrap `engine.generate` so that every answer's (ids, log-probs, versions) is added to the returned set."""
    answers, generate = set(), engine.generate

    def recording(prompts, params):
        gens = generate(prompts, params)
        answers.update((tuple(g.token_ids), tuple(g.logprobs), tuple(g.versions)) for g in gens)
        return gens

    engine.generate = recording
    return answers


def gateway_train_steps(tmp_path, agent: str):
    """Three train.py steps of task=gateway_agent played by `agent` ("pkg.module:function"), the test-size
    model with 6 tokens a turn and 2 turns: every episode of every rollout works (nothing dropped; a rewritten
    history is a segment more) and every action trained on is an engine answer as produced (ids, log-probs,
    versions). Returns the run."""
    import glmlight
    from glmlight import compose
    from tests.conftest import overrides_for_tests

    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "task=gateway_agent", "rollout.mode=sync", "trainer.max_steps=3",
        f"task.agent.gateway.agent={agent}", "task.reward._target_=glmlight.gateway.rewards.CalculatorAnswer",
        "rollout.max_new_tokens=6", "task.agent.max_turns=2", "rollout.max_context=512",
        "~callbacks.held_out_eval", "~callbacks.sample_table")))
    answers, trained = record_answers(run.datamodule.engine), TrainedActions()
    run.trainer.callbacks.append(trained)
    run.fit()
    assert run.module.policy_version == 3
    t = run.datamodule.totals
    assert t["produced"] == t["trained"] >= 3 * 16, dict(t)
    assert trained.turns and set(trained.turns) <= answers
    return run
