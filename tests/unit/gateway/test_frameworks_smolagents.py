"""smolagents 1.26 (the `frameworks` extra) through the agent gateway on its default path: a
`ToolCallingAgent` with a calculator tool over an `OpenAIServerModel` pointed at the episode's base URL,
which asks every step with `tool_choice: "required"` (smolagents' `Model._prepare_completion_kwargs`).
Three train.py steps: no episode fails (before: every one did, a 400 on the forced tool_choice, as
bad_request), and every action turn trained on is an engine answer as produced (ids, log-probs, versions). And under
a Hermes-style template, with scripted model answers: the forced tool-call opening makes each step a call,
and the agent finishes with its final_answer tool."""

import importlib.resources
import json
import pathlib
from collections import Counter

import pytest
import yaml

import glmlight
from glmlight import compose
from glmlight.prompt import Prompt
from glmlight.engines.base import SamplingParams
from glmlight.gateway.runner import GatewayOptions, GatewayRollout
from glmlight.models.tokenizer import build_char_tokenizer, stop_token_ids
from glmlight.sample import Status
from tests.conftest import overrides_for_tests
from tests.support.scripted_engine import ScriptedEngine
from tests.support.tito import TrainedActions, record_answers
from tests.unit.gateway.test_gateway_formats import HERMES_TEMPLATE

smolagents = pytest.importorskip("smolagents", reason="smolagents: pip install -e '.[frameworks]'")
from smolagents import tool  # noqa: E402 - after the skip


@tool
def calc(expr: str) -> str:
    """The exact value of a product such as 37*58.

    Args:
        expr: the product, e.g. 37*58
    """
    a, _, b = expr.partition("*")
    try:
        return str(int(a) * int(b))
    except ValueError:
        return "error: expected a*b"


# smolagents' own prompts with a short system prompt: its 3.8k-character default would need a context budget
# of thousands of tokens for the test-size model's character tokenizer; the request path is the default one.
_PROMPTS = yaml.safe_load(
    importlib.resources.files("smolagents.prompts").joinpath("toolcalling_agent.yaml").read_text())
_PROMPTS["system_prompt"] = "Solve the task with the tools. Finish with final_answer."


def solve(task):
    """smolagents' tool-calling loop (two steps, then its final answer) against the episode: its answer."""
    model = smolagents.OpenAIServerModel(model_id="glmlight", api_base=task.openai_base_url, api_key=task.api_key,
                                         client_kwargs={"max_retries": 0})
    agent = smolagents.ToolCallingAgent(tools=[calc], model=model, max_steps=2, prompt_templates=_PROMPTS,
                                        verbosity_level=smolagents.LogLevel.OFF)
    return agent.run(task.messages[-1]["content"])


def run(task):
    """One episode (its reward is the task's: the callable returns nothing)."""
    solve(task)


def test_smolagents_tool_calling_agent_through_train_steps(tmp_path):
    run_ = glmlight.build(compose(overrides_for_tests(
        tmp_path, "task=gateway_agent", "rollout.mode=sync", "trainer.max_steps=3",
        "task.agent.gateway.agent=tests.unit.gateway.test_frameworks_smolagents:run",
        "task.reward._target_=glmlight.gateway.rewards.CalculatorAnswer",
        "rollout.max_new_tokens=6", "task.agent.max_turns=3", "rollout.max_context=1024",
        "~callbacks.held_out_eval", "~callbacks.sample_table")))
    answers, trained = record_answers(run_.datamodule.engine), TrainedActions()
    run_.trainer.callbacks.append(trained)
    run_.fit()
    assert run_.module.policy_version == 3
    t = run_.datamodule.totals
    assert not any(v for k, v in t.items() if k.startswith("dropped/")), dict(t)  # bad_request before
    assert t["produced"] == t["trained"] >= 3 * 16, dict(t)
    assert trained.turns and set(trained.turns) <= answers  # every action: an engine answer (ids, log-probs, versions)
    rows = [json.loads(line) for line in next(pathlib.Path(tmp_path).rglob("metrics.jsonl")).read_text().splitlines()]
    forced = sum(r.get("rollout/gateway_forced_calls", 0) for r in rows)
    assert forced >= 3 * 16, rows[-1]  # smolagents asked with tool_choice "required" on every step


def test_smolagents_gets_forced_calls_under_a_hermes_template():
    """`tool_choice: "required"` with smolagents' two tools (calc and its final_answer): each step's context
    ends with the template's forced opening `<tool_call>{"name": "` (context, loss mask 0), the model writes
    the rest, and smolagents runs calc, then returns the final answer."""
    tok = build_char_tokenizer()
    tok.chat_template = HERMES_TEMPLATE
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # noqa: E731
    engine = ScriptedEngine([(ids('calc", "arguments": {"expr": "37*58"}}</tool_call>'), "stop"),
                             (ids('final_answer", "arguments": {"answer": "2146"}}</tool_call>'), "stop")])
    answers, counts = [], Counter()
    params = lambda n: SamplingParams(max_new_tokens=64, stop_token_ids=stop_token_ids(tok))  # noqa: E731
    (ge,) = GatewayRollout(engine, tok, GatewayOptions(agent=lambda task: answers.append(solve(task))), params, 4,
                           4096, counts).run([Prompt(messages=[{"role": "user", "content": "37*58="}])])
    assert answers == ["2146"] and ge.ep.status is Status.COMPLETED, ge.failure
    assert [(c.name, c.arguments) for c in ge.calls] == [("calc", {"expr": "37*58"}),
                                                         ("final_answer", {"answer": "2146"})]
    assert counts["gateway_forced_calls"] == 2 and not counts["gateway_forced_unparsed"]
    opening = tok('<tool_call>{"name": "', add_special_tokens=False)["input_ids"]
    assert all(ctx[-len(opening):] == opening for ctx in engine.contexts)
