"""The OpenAI Agents SDK (`openai-agents`, the `frameworks` extra) through the agent gateway, written the
SDK's documented way: `Runner.run` with a function tool, its `OpenAIProvider` on the Chat Completions
path (`use_responses=False`), whose clients share the SDK's one process-wide httpx client. Three
train.py steps, each a rollout of coroutine agents: every episode works in every rollout (the agents
share the gateway's one event loop, glmlight.gateway.event_loop)."""

import logging

import openai
import pytest

import glmlight
from glmlight import compose
from tests.conftest import overrides_for_tests

agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK: pip install -e '.[frameworks]'")
from agents.models.openai_provider import OpenAIProvider  # noqa: E402

agents.set_tracing_disabled(True)


@agents.function_tool
def calc(expression: str) -> str:
    """Evaluate an arithmetic expression such as 37*58."""
    a, _, b = expression.partition("*")
    try:
        return str(int(a) * int(b))
    except ValueError:
        return "error: expected a*b"


_AGENT = agents.Agent(name="calculator", instructions="Use calc, then answer with the number.", tools=[calc])


_CLIENT = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="unset", max_retries=0)  # made once


async def _run(task, provider):
    config = agents.RunConfig(model_provider=provider, model="glmlight", tracing_disabled=True)
    try:
        await agents.Runner.run(_AGENT, task.messages[-1]["content"], max_turns=2, run_config=config)
    except agents.MaxTurnsExceeded:  # the test-size model may call tools to the end: its episode still counts
        pass


async def run(task):
    """One episode: the SDK's agent loop against the episode's base URL and key, its provider's client on
    the SDK's process-wide httpx client."""
    await _run(task, OpenAIProvider(api_key=task.api_key, base_url=task.openai_base_url, use_responses=False))


async def run_one_client(task):
    """The same with one AsyncOpenAI made once for the process (its per-episode copies share its httpx
    client), as the SDK's docs do with `set_default_openai_client` or `openai_client=`."""
    client = _CLIENT.with_options(base_url=task.openai_base_url, api_key=task.api_key)
    await _run(task, OpenAIProvider(openai_client=client, use_responses=False))


@pytest.mark.parametrize("agent", ["run", "run_one_client"])
def test_agents_sdk_runner_through_train_steps(tmp_path, caplog, agent):
    caplog.set_level(logging.WARNING)
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "task=gateway_agent", "rollout.mode=sync", "trainer.max_steps=3",
        f"task.agent.gateway.agent=tests.unit.gateway.test_agents_sdk:{agent}",
        "task.reward._target_=glmlight.gateway.rewards.CalculatorAnswer",
        "rollout.max_new_tokens=6", "task.agent.max_turns=2", "rollout.max_context=512",
        "~callbacks.held_out_eval", "~callbacks.sample_table")))
    run.fit()
    assert run.module.policy_version == 3
    t = run.datamodule.totals
    assert t["produced"] == t["trained"] + sum(v for k, v in t.items() if k.startswith("dropped/"))
    assert not t["dropped/agent_crashed"] and not t["dropped/agent_timeout"], dict(t)
    assert t["trained"] >= 3 * 16 - t["dropped/group_failed"], dict(t)
    for bad in ("Event loop is closed", "bound to a different event loop", "never retrieved"):
        assert bad not in caplog.text
