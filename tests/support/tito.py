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


def responses_round_trip(tokenizer, agent, monkeypatch):
    """A framework's agent `agent` through one gateway episode on the Responses wire, against a policy that calls
    `calc` and then answers with its result (the calculator environment's expert). Checks what every framework
    on its default path must give: the function tool run and its output sent back as a function_call_output
    item, each request extending the episode's record (no history rewritten), the actions the engine's answers
    as produced. Returns the episode and the request bodies as the framework sent them."""
    from collections import Counter

    from glmlight.agents.envs import CalculatorEnv
    from glmlight.agents.expert import ExpertEngine
    from glmlight.engines.base import SamplingParams
    from glmlight.gateway import responses_wire
    from glmlight.gateway.runner import GatewayOptions, GatewayRollout
    from glmlight.prompt import Prompt
    from glmlight.sample import Status
    from tests.unit.gateway.test_gateway import Recorder, _check_record

    bodies, parse = [], responses_wire.parse_request
    monkeypatch.setattr(responses_wire, "parse_request", lambda body: (bodies.append(body), parse(body))[1])
    env = CalculatorEnv(system_prompt=None, expert_calc_rate=1.0)
    engine = Recorder(ExpertEngine(tokenizer, env.expert))
    (ge,) = GatewayRollout(engine, tokenizer, GatewayOptions(agent=agent, reward="agent"),
                           lambda n: SamplingParams(max_new_tokens=16, stop_token_ids=[tokenizer.eos_token_id]),
                           4, 512, Counter()).run([Prompt(messages=[{"role": "user", "content": "37*58="}])])
    assert ge.failure is None and ge.ep.status is Status.COMPLETED and ge.rewrites == 0 and ge.ep.turns == 2
    assert [(c.name, c.arguments) for c in ge.calls] == [("calc", {"expression": "37*58"})]
    assert tokenizer.decode(ge.ep.prompt_ids + ge.ep.response_ids) == (
        "<|system|>Use calc, then answer with the number.<|user|>37*58=<|assistant|>calc: 37*58<eos>"
        "<|observation|>= 2146<|assistant|>answer: 2146<eos>")
    assert _check_record(ge.ep, engine.calls) == 2
    return ge, bodies
