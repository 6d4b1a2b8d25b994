"""The OpenAI Agents SDK (`openai-agents`, a dev extra) through the agent gateway, written the SDK's documented
way: `Runner.run` with a function tool. Its default path, `OpenAIProvider()` with `use_responses` left at its
default (the Responses API, /v1/responses), non-streamed and streamed (`Runner.run_streamed`); and its Chat
Completions path (`use_responses=False`), whose clients share the SDK's one process-wide httpx client, with
a per-episode provider and with one `AsyncOpenAI` made once. A scripted calculator policy shows a tool call
round trip on the default path (no history rewritten); three train.py steps per path, each a rollout of
coroutine agents, show every episode working in every rollout (the agents share the gateway's one event loop,
glmlight.gateway.event_loop) and every action trained on being the engine's ids and log-probs as produced."""

import logging

import agents
import openai
import pytest
from agents.models.openai_provider import OpenAIProvider

from tests.support.tito import gateway_train_steps, responses_round_trip

agents.set_tracing_disabled(True)


@agents.function_tool
def calc(expression: str) -> str:
    """Evaluate an arithmetic expression such as 37*58."""
    a, _, b = expression.partition("*")
    try:
        return f"= {int(a) * int(b)}"
    except ValueError:
        return "error: expected a*b"


_AGENT = agents.Agent(name="calculator", instructions="Use calc, then answer with the number.", tools=[calc])


_CLIENT = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="unset", max_retries=0)  # made once


def _cut_at_budget(e: agents.ModelBehaviorError) -> bool:
    """The SDK's Responses path raises on a response that is `incomplete`: a turn cut at the token budget."""
    return "response.incomplete" in str(e)


async def _run(task, provider, streamed=False):
    config = agents.RunConfig(model_provider=provider, model="glmlight", tracing_disabled=True)
    try:
        if streamed:
            result = agents.Runner.run_streamed(_AGENT, task.messages[-1]["content"], max_turns=2, run_config=config)
            async for _ in result.stream_events():
                pass
        else:
            result = await agents.Runner.run(_AGENT, task.messages[-1]["content"], max_turns=2, run_config=config)
        return {"reward": 0.0, "info": {"final_output": result.final_output}}
    except agents.MaxTurnsExceeded:  # the test-size model may call tools to the end: its episode still counts
        pass
    except agents.ModelBehaviorError as e:  # the test-size model's turns are mostly cut at its 6-token budget
        if not _cut_at_budget(e):
            raise


async def run_responses(task):
    """One episode on the SDK's default path: `OpenAIProvider` as made by default (the Responses API)."""
    return await _run(task, OpenAIProvider(api_key=task.api_key, base_url=task.openai_base_url))


async def run_responses_streamed(task):
    """The same, streamed (`Runner.run_streamed`)."""
    return await _run(task, OpenAIProvider(api_key=task.api_key, base_url=task.openai_base_url), streamed=True)


async def run(task):
    """One episode on the Chat Completions path, its provider's client on the SDK's process-wide httpx client."""
    await _run(task, OpenAIProvider(api_key=task.api_key, base_url=task.openai_base_url, use_responses=False))


async def run_one_client(task):
    """The same with one AsyncOpenAI made once for the process (its per-episode copies share its httpx
    client), as the SDK's docs do with `set_default_openai_client` or `openai_client=`."""
    client = _CLIENT.with_options(base_url=task.openai_base_url, api_key=task.api_key)
    await _run(task, OpenAIProvider(openai_client=client, use_responses=False))


@pytest.mark.parametrize("agent", [run_responses, run_responses_streamed])
def test_default_path_tool_call_round_trip(tokenizer, monkeypatch, agent):
    """A policy that calls `calc` and then answers with its result (the calculator environment's expert): on
    the SDK's default path the SDK runs the function tool, sends its output back as a function_call_output
    item, and gets the answer as its final output; each request extends the episode's record (no history
    rewritten), whose actions are the engine's answers as produced."""
    ge, bodies = responses_round_trip(tokenizer, agent, monkeypatch)
    assert ge.reported["info"] == {"final_output": "answer: 2146"}
    # the request fields it sends on this path (docs/agents.md, the frameworks tested)
    sent = ["include", "input", "instructions", "model", "tools"] + ["stream"] * (agent is run_responses_streamed)
    assert [sorted(b) for b in bodies] == [sorted(sent)] * 2
    assert [t.get("strict") for b in bodies for t in b["tools"]] == [True] * 2  # strict: honoured (docs/agents.md)
    assert [i.get("type", "message") for i in bodies[1]["input"]] == ["message", "function_call",
                                                                      "function_call_output"]


@pytest.mark.parametrize("agent", ["run_responses", "run_responses_streamed", "run", "run_one_client"])
def test_agents_sdk_runner_through_train_steps(tmp_path, caplog, agent):
    caplog.set_level(logging.WARNING)
    gateway_train_steps(tmp_path, f"tests.unit.gateway.test_frameworks_agents_sdk:{agent}")
    for bad in ("Event loop is closed", "bound to a different event loop", "never retrieved"):
        assert bad not in caplog.text
