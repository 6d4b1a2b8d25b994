"""The agent gateway under each chat template the project ships or is used with (the tiny model's, SmolLM2's
ChatML, GLM-4.5's), driven by the official `openai` client with scripted model answers: a tool call, the
tool's result, an answer, a user turn, an answer. Every context the engine continues is the template's own
rendering of the conversation the agent holds, token for token."""

import json
from collections import Counter

import openai
import pytest

from glmlight.prompt import Prompt
from glmlight.engines.base import SamplingParams
from glmlight.gateway.runner import GatewayOptions, GatewayRollout
from glmlight.models.tokenizer import encode_chat, stop_token_ids
from glmlight.sample import Status
from tests.support.chat_templates import ANSWER_PREFIX, TOKENIZERS, end_token
from tests.support.scripted_engine import ScriptedEngine

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "exact value", "parameters": {
    "type": "object", "properties": {"expr": {"type": "string"}}}}}]


def _script(name, tok, cut):
    """The model's three answers (ids, finish reason) and the conversation as the chat template takes it."""
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prefix = ANSWER_PREFIX[name]
    if name == "glm45":  # the template renders the structured call itself
        call = prefix + "<tool_call>calc\n<arg_key>expr</arg_key>\n<arg_value>2*3</arg_value>\n</tool_call>"
        call_turn = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calc", "arguments": {"expr": "2*3"}}}]}
        tool_turn = {"role": "tool", "content": "6"}
    else:  # glmlight's line format: the call is a line of the text; the result an observation turn
        call = "calc: 2*3"
        call_turn, tool_turn = {"role": "assistant", "content": call}, {"role": "observation", "content": "6"}
    answers = [(ids(call) + [end_token(name, tok, "tool")], "stop"),
               (ids(prefix + "It is 6."), "length") if cut else
               (ids(prefix + "It is 6.") + [end_token(name, tok, "user")], "stop"),
               (ids(prefix + "12") + [end_token(name, tok, "user")], "stop")]
    conversation = [{"role": "user", "content": "2*3?"}, call_turn, tool_turn,
                    {"role": "assistant", "content": "It is 6."}, {"role": "user", "content": "Double it?"}]
    return answers, conversation


@pytest.mark.parametrize("cut", [False, True], ids=["ended", "cut"])
@pytest.mark.parametrize("name", ["tiny", "smollm2", "glm45"])
def test_gateway_contexts_are_the_templates_rendering_turn_by_turn(name, cut):
    """With GLM-4.5's template the model ends a turn with the next role marker (`<|observation|>` before the
    tool result, `<|user|>` before a user turn); the spliced turn must not render that marker again. With
    `cut`, the second answer has no end token (max_tokens), and the splice adds what the template puts there."""
    tok = TOKENIZERS[name]()
    answers, conversation = _script(name, tok, cut)
    engine = ScriptedEngine(answers)
    seen = {}

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            msgs = list(task.messages)
            m = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS).choices[0].message
            seen["call"] = (m.tool_calls[0].function.name, json.loads(m.tool_calls[0].function.arguments))
            msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id,
                                                       "content": "6"}]
            m = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS).choices[0].message
            seen["answer"] = m.content
            msgs += [m.model_dump(exclude_none=True), {"role": "user", "content": "Double it?"}]
            seen["final"] = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS).choices[0].message.content

    params = lambda n: SamplingParams(max_new_tokens=64, stop_token_ids=stop_token_ids(tok))  # noqa: E731
    (ge,) = GatewayRollout(engine, tok, GatewayOptions(agent=agent), params, 4, 1024, Counter()).run(
        [Prompt(messages=[{"role": "user", "content": "2*3?"}])])
    assert ge.ep.status is Status.COMPLETED and ge.rewrites == 0 and ge.ep.turns == 3
    assert seen["call"] == ("calc", {"expr": "2*3"})
    assert seen["answer"].endswith("It is 6.") and seen["final"].endswith("12")
    assert len(engine.contexts) == 3
    for ctx, upto in zip(engine.contexts, (1, 3, 5)):
        expected = encode_chat(tok, conversation[:upto], add_generation_prompt=True, tools=TOOLS)
        assert ctx == expected, (f"after {upto} messages the context differs from the template's rendering\n"
                                 f"context:  {tok.decode(ctx)!r}\ntemplate: {tok.decode(expected)!r}")
    assert ge.ep.context[: len(engine.contexts[-1])] == engine.contexts[-1]
