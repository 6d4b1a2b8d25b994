"""The agentic TITO loop and asynchronous rollout (real engine, tiny model)."""

import threading
import time
from collections import Counter

import lightning.pytorch as pl
import pytest

import glmlight
from glmlight.agents import AgentLoop, StepResult, encode_observation, generation_prompt
from glmlight.agents.envs import CalculatorEnv, RunningSumEnv, RunningSumTask, safe_eval
from glmlight.agents.expert import parse_transcript
from glmlight.config.rollout import RolloutConfig
from glmlight.agents.options import AgentOptions
from glmlight.data.rollout import RolloutDataModule
from glmlight.data.sources import ArithmeticTask
from glmlight.prompt import Prompt
from glmlight.engines.base import Generation, SamplingParams
from glmlight.models.tokenizer import encode_chat
from glmlight.engines.local.engine import LocalEngine
from glmlight.sample import Status
from tests.conftest import overrides_for_tests
from glmlight import compose


class ScriptedEnv:
    """Answers every action with a fixed observation; done after `turns` actions."""

    def __init__(self, turns=3, crash_at=None):
        self.turns, self.crash_at, self.t = turns, crash_at, 0

    def reset(self, prompt):
        return list(prompt.messages)

    def step(self, action):
        self.t += 1
        if self.crash_at == self.t:
            raise RuntimeError("tool server died")
        if self.t >= self.turns:
            return StepResult(None, reward=1.0, done=True)
        return StepResult(f"obs {self.t}")


def _greedy(ctx):
    return SamplingParams(temperature=0.0, max_new_tokens=5)


def _prompt(text="2*3="):
    return Prompt(messages=[{"role": "user", "content": text}], label="6")


def test_episode_ids_are_engine_outputs_and_observation_encodings(tokenizer, tiny_model):
    engine = LocalEngine(tiny_model)
    loop = AgentLoop(engine, tokenizer, lambda: ScriptedEnv(turns=3), _greedy, max_turns=5)
    ep = loop.run([_prompt()])[0]
    assert ep.status is Status.COMPLETED and ep.turns == 3 and ep.reward == 1.0
    # Rebuild the context turn by turn: each action is exactly what the engine answers for the
    # context so far; each observation is exactly the encoding of the environment's text.
    expected = list(ep.prompt_ids)
    for t in range(3):
        action = engine.generate([expected], _greedy(0))[0]
        expected += action.token_ids
        if t < 2:  # a turn cut by max_new_tokens is closed as the template closes one (<eos>)
            expected += [tokenizer.eos_token_id] + encode_observation(tokenizer, f"obs {t + 1}")
            expected += generation_prompt(tokenizer)
    assert ep.prompt_ids + ep.response_ids == expected
    obs = [tokenizer.eos_token_id] + encode_observation(tokenizer, "obs 1") + generation_prompt(tokenizer)
    assert ep.loss_mask.count(0) == 2 * len(obs)  # two observation turns, masked out
    assert all(lp == 0.0 and v == -1 for lp, v, m in zip(ep.logprobs, ep.versions, ep.loss_mask) if m == 0)
    assert all(v == 0 for v, m in zip(ep.versions, ep.loss_mask) if m == 1)


class ScriptedEngine:
    """Answers each call with the next scripted token ids."""

    def __init__(self, answers):
        self.answers, self.version = list(answers), 0

    def generate(self, prompts, params):
        ids = self.answers.pop(0)
        return [Generation(ids, [-0.5] * len(ids), "stop", [0] * len(ids))]


# ChatML as SmolLM2's template renders it: a default system prompt when the conversation has none, each
# turn closed by <eos> (its <|im_end|>) and a newline.
CHATML_WITH_DEFAULT_SYSTEM = (
    "{% if messages[0].role != 'system' %}<|system|>You help.<eos>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.parametrize("role", ["observation", "user"])
def test_spliced_turns_are_the_templates_rendering_of_the_whole_conversation(tokenizer, role):
    """With a template that opens every conversation with a default system prompt and follows each turn's
    end token with a newline: an episode (a turn the model ended with <eos>, one cut by max_new_tokens,
    a final answer) is exactly the template's rendering of the whole conversation, the model's ids
    untouched. Before, each observation carried the default system prompt again and no newline."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHATML_WITH_DEFAULT_SYSTEM
    eos = tok.eos_token_id
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    actions = [ids("calc: 2*3") + [eos], ids("calc: 6+"), ids("answer: 6") + [eos]]
    params = lambda n: SamplingParams(max_new_tokens=8, stop_token_ids=[eos])  # noqa: E731
    loop = AgentLoop(ScriptedEngine(actions), tok, lambda: ScriptedEnv(turns=3), params, max_turns=5,
                     observation_role=role)
    ep = loop.run([_prompt()])[0]
    assert ep.status is Status.COMPLETED and ep.turns == 3
    whole = [{"role": "user", "content": "2*3="}, {"role": "assistant", "content": "calc: 2*3"},
             {"role": role, "content": "obs 1"}, {"role": "assistant", "content": "calc: 6+"},
             {"role": role, "content": "obs 2"}, {"role": "assistant", "content": "answer: 6"}]
    assert ep.context + ids("\n") == encode_chat(tok, whole, add_generation_prompt=False)
    assert [t for t, m in zip(ep.response_ids, ep.loss_mask) if m] == [t for a in actions for t in a]


def test_env_crash_fails_the_sample_and_is_counted(tokenizer, tiny_model):
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, max_new_tokens=4)
    dm = RolloutDataModule(LocalEngine(tiny_model), tokenizer, ArithmeticTask(seed=0), None, cfg,
                           agent=AgentOptions(env_factory=lambda: ScriptedEnv(turns=3, crash_at=2), max_turns=4))
    counts = Counter()
    samples = dm.rollout(dm.draw_prompts(2), 2, counts)
    assert all(s.status is Status.FAILED and "tool server died" in s.metadata["env_error"] for s in samples)
    assert counts["env_failed"] == 4
    with pytest.raises(RuntimeError, match="no trainable samples"):
        dm.next_experience()
    assert dm.totals["dropped/failed"] + dm.totals["dropped/group_failed"] == dm.totals["produced"]


def test_only_the_listed_domains_run_as_episodes(tokenizer, tiny_model):
    """task.agent.domains: prompts of a listed domain are episodes of the environment (its reward); the
    others are single-turn answers scored by the task's reward."""
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, max_new_tokens=4)
    dm = RolloutDataModule(LocalEngine(tiny_model), tokenizer, ArithmeticTask(seed=0), lambda s: 0.25, cfg,
                           agent=AgentOptions(env_factory=lambda: ScriptedEnv(turns=2), max_turns=4,
                                                    domains=frozenset(["agent"])))
    prompts = [Prompt(messages=[{"role": "user", "content": "2*3="}], label="6", domain=d)
               for d in ("agent", "math", "agent")]
    counts = Counter()
    samples = dm.rollout(prompts, 2, counts)
    by_domain = {d: [s for s in samples if s.metadata["domain"] == d] for d in ("agent", "math")}
    assert len(by_domain["agent"]) == 4 and len(by_domain["math"]) == 2
    assert all(s.metadata["turns"] == 2 and s.reward == 1.0 and 0 in s.loss_mask for s in by_domain["agent"])
    assert all("turns" not in s.metadata and s.reward == 0.25 and set(s.loss_mask) == {1} for s in by_domain["math"])
    assert counts["agent_turns"] == 8 and counts["produced"] == 6
    assert len({s.group_id for s in samples}) == 3


def test_turn_limit_and_context_budget_truncate(tokenizer, tiny_model):
    engine = LocalEngine(tiny_model)
    ep = AgentLoop(engine, tokenizer, lambda: ScriptedEnv(turns=10), _greedy, max_turns=2).run([_prompt()])[0]
    assert ep.status is Status.TRUNCATED and ep.turns == 2
    short = AgentLoop(engine, tokenizer, lambda: ScriptedEnv(turns=10), _greedy, max_turns=10, max_context=24)
    ep = short.run([_prompt()])[0]
    assert ep.status is Status.TRUNCATED and len(ep.prompt_ids) + len(ep.response_ids) <= 24


def test_calculator_env():
    env = CalculatorEnv(tool_bonus=0.1)
    env.reset(Prompt(messages=[{"role": "user", "content": "12*3="}], label="36"))
    assert env.step("calc: 12*3") == StepResult("= 36", reward=0.1, info={"tool_calls": 1})
    assert env.step("calc: __import__('os')").observation.startswith("error:")
    assert env.step("calc: 1//0").observation.startswith("error:")
    assert env.step("hello").info == {"malformed": True}
    done = env.step("answer: 36")
    assert done.done and done.reward == 1.0
    assert env.step("answer: 35").reward == 0.0
    with pytest.raises(ValueError):
        safe_eval("2**100000")


def test_calculator_env_examples_sit_between_the_system_prompt_and_the_question():
    """A few-shot prompt for a chat model (experiment=smollm2_agent): solved episodes before the question;
    the expert still answers the question, not an example."""
    examples = [{"role": "user", "content": "What is 2 * 3?"}, {"role": "assistant", "content": "calc: 2 * 3"},
                {"role": "user", "content": "= 6"}, {"role": "assistant", "content": "answer: 6"}]
    env = CalculatorEnv(system_prompt="tools", examples=examples)
    prompt = Prompt(messages=[{"role": "system", "content": "dropped"}, {"role": "user", "content": "12*3="}],
                    label="36")
    assert env.reset(prompt) == [{"role": "system", "content": "tools"}, *examples, {"role": "user", "content": "12*3="}]
    assert env.expert(env.reset(prompt)) == "calc: 12*3"
    with pytest.raises(ValueError, match="user and assistant turns"):
        CalculatorEnv(examples=[{"role": "observation", "content": "= 6"}])


def test_running_sum_env():
    task = RunningSumTask(num_steps=3, seed=0)[0]
    d = task.metadata["deltas"]
    env = RunningSumEnv()
    env.reset(task)
    assert env.step(str(d[0])).observation == f"+{d[1]}"
    env.step("0")
    last = env.step(str(sum(d)))
    assert last.done and last.reward == pytest.approx(2 / 3)


def test_running_sum_expert_reads_observations_in_user_turns_after_a_few_shot_prompt():
    """A chat template without a tool role (observation_role=user, e.g. SmolLM2's ChatML): the revealed
    numbers arrive as user turns, after the system prompt and the solved examples, which hold numbers of
    their own; the expert's total counts only this episode's."""
    examples = [{"role": "user", "content": "Running sum. Start: 7"}, {"role": "assistant", "content": "7"}]
    env = RunningSumEnv(system_prompt="Count the ones.", examples=examples, expert_summary_rate=1.0)
    task = RunningSumTask(num_steps=3, seed=0)[0]
    opening = env.reset(task)
    assert opening[:3] == [{"role": "system", "content": "Count the ones."}] + examples
    d = task.metadata["deltas"]
    turns = opening + [{"role": "assistant", "content": str(d[0])}, {"role": "user", "content": f"+{d[1]}"}]
    assert env.expert(turns) == str(d[0] + d[1])
    assert env.expert(turns + [{"role": "user", "content": "Summarize."}], summarize=True) == str(d[0] + d[1])
    resumed = opening + [{"role": "user", "content": "Summary: 12"}]
    assert env.expert(resumed + [{"role": "assistant", "content": "12"}, {"role": "user", "content": "+1"}]) == "13"
    lossy = RunningSumEnv(system_prompt="Count the ones.", examples=examples, expert_summary_rate=0.0)
    lossy.reset(task)
    assert lossy.expert(turns + [{"role": "user", "content": "Summarize."}], summarize=True) == str(d[1])


def test_parse_transcript_reads_a_chatml_context():
    text = ("<|im_start|>system\nCount the ones.<|im_end|>\n<|im_start|>user\nRunning sum. Start: 1<|im_end|>\n"
            "<|im_start|>assistant\n1<|im_end|>\n<|im_start|>user\n+0<|im_end|>\n<|im_start|>assistant\n")
    assert parse_transcript(text, "<|im_end|>") == [
        {"role": "system", "content": "Count the ones."}, {"role": "user", "content": "Running sum. Start: 1"},
        {"role": "assistant", "content": "1"}, {"role": "user", "content": "+0"}]


def _build(tmp_path, *extra):
    return glmlight.build(compose(overrides_for_tests(tmp_path, *extra)))


@pytest.mark.parametrize("mode, on_update", [("sync", "continue"), ("async", "continue"), ("async", "abort")])
def test_grpo_on_calculator_agent(tmp_path, mode, on_update):
    run = _build(tmp_path, "task=calculator_agent", f"rollout.mode={mode}", "trainer.max_steps=2",
                 f"rollout.on_weight_update={on_update}",
                 "rollout.max_new_tokens=6", "task.agent.max_turns=2", "~callbacks.held_out_eval",
                 "~callbacks.sample_table")
    run.fit()
    assert run.module.policy_version == 2
    t = run.datamodule.totals
    dropped = sum(v for k, v in t.items() if k.startswith("dropped/"))
    assert t["produced"] == t["trained"] + dropped  # nothing produced is lost, even in async mode
    assert not [th for th in threading.enumerate() if th.name == "glmlight-rollout-producer"]


def test_async_staleness_is_bounded_by_the_gate(tmp_path):
    run = _build(tmp_path, "rollout.mode=async", "rollout.queue_size=2", "trainer.max_steps=5",
                 "callbacks.version_gate.max_staleness=1", "~callbacks.held_out_eval", "~callbacks.sample_table")
    seen = []
    real_next = run.datamodule.next_experience

    def recording_next():
        exp = real_next()
        seen.append(max(run.module.policy_version - s.first_version for s in exp.samples))
        return exp

    run.datamodule.next_experience = recording_next
    run.fit()
    assert seen and max(seen) <= 1
    t = run.datamodule.totals
    assert t["produced"] == t["trained"] + sum(v for k, v in t.items() if k.startswith("dropped/"))
    assert not [th for th in threading.enumerate() if th.name == "glmlight-rollout-producer"]


def test_async_producer_runs_one_batch_ahead_so_nothing_goes_stale(tmp_path):
    # training much slower than generation: the producer must wait for the trainer to take a batch
    # before starting the next one, or its batches reach the gate two versions old and are dropped
    run = _build(tmp_path, "rollout.mode=async", "rollout.queue_size=1", "trainer.max_steps=4",
                 "callbacks.version_gate.max_staleness=1", "~callbacks.held_out_eval", "~callbacks.sample_table")

    class SlowTrainer(pl.Callback):
        def on_train_batch_end(self, *args, **kwargs):
            time.sleep(0.3)

    run.trainer.callbacks.append(SlowTrainer())
    run.fit()
    t = run.datamodule.totals
    assert t["dropped/stale"] == 0 and t["dropped/group_stale"] == 0
    assert t["trained"] == 4 * run.cfg.rollout.rollout_batch_size * run.cfg.rollout.n_samples_per_prompt
    assert t["produced"] == t["trained"] + sum(v for k, v in t.items() if k.startswith("dropped/"))


def test_the_calculator_expert_reads_a_glm45_context_and_ends_its_actions_as_a_glm_model_does():
    """GLM-4.5's template wraps a turn's text (`<think></think>` before an answer, `<tool_response>` around a tool
    result) and closes an assistant turn with nothing: the model ends it by sampling the next role marker. The
    expert reads the tool's result through the wrapping and answers; its actions end with `<|observation|>`."""
    from glmlight.agents.envs import CalculatorEnv
    from glmlight.agents.expert import action_end
    from glmlight.models.chat_templates import glm45_tokenizer

    tok = glm45_tokenizer()
    msgs = [{"role": "user", "content": "23*13="}, {"role": "assistant", "content": "calc: 23*13"},
            {"role": "tool", "content": "= 299"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "<think></think>" in text and "<tool_response>" in text
    parsed = parse_transcript(text)
    assert parsed == [{"role": "user", "content": "23*13="}, {"role": "assistant", "content": "calc: 23*13"},
                      {"role": "observation", "content": "= 299"}]
    assert CalculatorEnv().expert(parsed) == "answer: 299"
    assert tok.convert_ids_to_tokens([action_end(tok, "tool")]) == ["<|observation|>"]
    assert action_end(tok, None) == tok.eos_token_id


def test_expert_episodes_under_glm45_are_the_templates_rendering_and_solve_the_task(tmp_path):
    """The calculator expert's episodes through the task's own data module, under GLM-4.5's template: each action
    is what a GLM-4.5 model writes (`\\n<think></think>\\n`, the call or answer, `<|observation|>`), so the episode
    is one growing rendering (no segment rewritten), and the expert answers after its one tool call."""
    from glmlight.agents.expert import ExpertEngine, assistant_opening, env_experts
    from glmlight.models.loading import load_tokenizer
    from glmlight.run.build import _datamodule_factory, build_policy, build_sources, expert_factory, model_tokenizer
    from glmlight.config.schema import validate
    from glmlight.rewards import task_reward

    cfg = validate(compose(overrides_for_tests(tmp_path, "task=calculator_agent", "model.arch=glm4moe",
                                               "model.chat_template=glm45", "task.agent.max_new_tokens=24")))
    tok = model_tokenizer(cfg.model)
    assert assistant_opening(tok) == "\n<think></think>\n" and assistant_opening(load_tokenizer(None)) == ""
    source = build_sources(cfg.task, cfg.seed)[0]
    make = _datamodule_factory(cfg, build_policy(cfg, tok, warm=False), tok, source, task_reward(cfg.task, source))
    (expert, _), *_ = env_experts(expert_factory(cfg.task.agent))
    counts = Counter()
    samples = make(ExpertEngine(tok, expert, None, "tool")).rollout([source[i] for i in range(6)], 1, counts)
    assert len(samples) == 6 and all(s.status is Status.COMPLETED for s in samples)  # answered after one call
    assert any(s.reward >= 1.0 for s in samples)
    assert counts["env_rewrites"] == 0
    text = tok.decode(samples[0].response_ids, skip_special_tokens=False)
    assert text.startswith("\n<think></think>\ncalc: ") and "<|observation|>\n<tool_response>\n= " in text
