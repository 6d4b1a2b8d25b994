"""pydantic-ai (`pydantic-ai-slim[openai]`, a dev extra) through the agent gateway on its default OpenAI path:
`OpenAIResponsesModel` (the Responses API, /v1/responses; what an `openai:<model>` string makes), an `Agent`
made once with a tool, run per episode with that episode's model (`OpenAIProvider(base_url=..., api_key=...)`,
whose clients share pydantic-ai's one cached httpx client), non-streamed (`Agent.run`) and streamed
(`Agent.run_stream`). A scripted calculator policy shows a tool call round trip (no history rewritten); three
train.py steps per way show every episode working and every action trained on being the engine's ids and
log-probs as produced (tests/support/tito.py: `gateway_train_steps`)."""

import logging
import os

import pytest
from pydantic_ai import Agent
from pydantic_ai.models import infer_model
from pydantic_ai.models.openai import OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

from tests.support.tito import gateway_train_steps, responses_round_trip

_AGENT = Agent(instructions="Use calc, then answer with the number.")


@_AGENT.tool_plain
def calc(expression: str) -> str:
    """Evaluate an arithmetic expression such as 37*58."""
    a, _, b = expression.partition("*")
    try:
        return f"= {int(a) * int(b)}"
    except ValueError:
        return "error: expected a*b"


def _model(task) -> OpenAIResponsesModel:
    provider = OpenAIProvider(base_url=task.openai_base_url, api_key=task.api_key)
    return OpenAIResponsesModel("glmlight", provider=provider)


async def run(task):
    """One episode: the agent's run against the episode's model."""
    result = await _AGENT.run(task.messages[-1]["content"], model=_model(task))
    return {"reward": 0.0, "info": {"output": result.output}}


async def run_streamed(task):
    async with _AGENT.run_stream(task.messages[-1]["content"], model=_model(task)) as result:
        output = await result.get_output()
    return {"reward": 0.0, "info": {"output": output}}


def test_an_openai_model_string_is_the_responses_model(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", os.environ.get("OPENAI_API_KEY", "unset"))
    assert isinstance(infer_model("openai:glmlight"), OpenAIResponsesModel)


@pytest.mark.parametrize("agent", [run, run_streamed])
def test_tool_call_round_trip(tokenizer, monkeypatch, agent):
    """A policy that calls `calc` and then answers with its result (the calculator environment's expert):
    pydantic-ai runs the tool, sends its return back as a function_call_output item, and takes the answer as
    its output; each request extends the episode's record (no history rewritten), whose actions are the
    engine's answers as produced."""
    ge, bodies = responses_round_trip(tokenizer, agent, monkeypatch)
    assert ge.reported["info"] == {"output": "answer: 2146"}
    # the request fields it sends on this path (docs/agents.md, the frameworks tested)
    sent = ["input", "instructions", "model", "stream", "tool_choice", "tools"]
    assert [sorted(b) for b in bodies] == [sent] * 2
    assert [t.get("strict") for b in bodies for t in b["tools"]] == [True] * 2  # strict: honoured (docs/agents.md)
    assert [i.get("type", "message") for i in bodies[1]["input"]] == ["message", "function_call",
                                                                      "function_call_output"]


@pytest.mark.parametrize("agent", ["run", "run_streamed"])
def test_pydantic_ai_agent_through_train_steps(tmp_path, caplog, agent):
    caplog.set_level(logging.WARNING)
    gateway_train_steps(tmp_path, f"tests.unit.gateway.test_frameworks_pydantic_ai:{agent}")
    for bad in ("Event loop is closed", "bound to a different event loop", "never retrieved"):
        assert bad not in caplog.text
