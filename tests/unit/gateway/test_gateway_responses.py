"""The agent gateway's OpenAI Responses wire (POST /v1/responses, glmlight/gateway/responses_wire.py): its
answers and stream events validated as the `openai` package's own pydantic types, driven by the official
`openai` client, streamed and not; its episodes token for token the Chat Completions wire's and the
calculator environment's; a final assistant message continued (prefill) and `strict` tools, as on the other
wires (its forced tool_choice: test_tool_choice.py); the requests it refuses, each in the wire's error form."""

import json

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from glmlight.agents import AgentLoop
from glmlight.agents.envs import CalculatorEnv
from glmlight.agents.expert import ExpertEngine
from glmlight.engines.base import SamplingParams
from glmlight.engines.local.engine import LocalEngine
from glmlight.gateway import responses_wire
from glmlight.gateway.messages import Message, ToolCall, WireError
from glmlight.sample import Status
from tests.support.chat_templates import TOKENIZERS, end_token
from tests.unit.gateway.test_gateway import Recorder, _check_record, _example, _greedy, _prompt, _rollout
from tests.unit.gateway.test_gateway_wire import _ids, _open
from tests.unit.gateway.test_gateway_wire import _rollout as _scripted

EVENTS = TypeAdapter(ResponseStreamEvent)
TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
          "parameters": t["function"]["parameters"], "strict": False}
         for t in _example("calculator_openai_agent", "TOOLS")]


def _calculator(tokenizer):
    env = CalculatorEnv(system_prompt=None, expert_calc_rate=1.0)
    return Recorder(ExpertEngine(tokenizer, env.expert)), env


def _sse(lines):
    """(event name, data) of each server-sent event in `lines`."""
    out, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            out.append((name, json.loads(line[6:])))
    return out


def _validated(events):
    """The stream's events as the openai package's types (validated, not constructed): every event once,
    numbered in order, named as its type; returns the final Response."""
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert all(name == d["type"] for name, d in events)
    typed = [EVENTS.validate_python(d) for _, d in events]
    assert [e.type for e in typed[:2]] == ["response.created", "response.in_progress"]
    assert typed[-1].type in ("response.completed", "response.incomplete")
    return typed


@pytest.mark.parametrize("stream", [False, True])
def test_responses_answers_are_the_openai_types_and_tool_calls_round_trip(tokenizer, stream):
    """The calculator through /v1/responses: a function_call item, its function_call_output sent back, the
    answer as a message item. Each answer (the raw JSON, and each stream event) validates as the openai
    package's Response and event types; the usage counts the turn's tokens; the second request goes to
    the bare /v1/responses with the episode's key. The episode is token for token the calculator
    environment's, as through the other wires."""
    engine, env = _calculator(tokenizer)
    run_tool = _example("calculator_openai_agent", "run_tool")
    got = {}

    def ask(client, items):
        kwargs = dict(model="m", instructions=None, input=items, tools=TOOLS, max_output_tokens=64, temperature=0.7,
                      parallel_tool_calls=False, store=True, metadata={"k": "v"})
        if not stream:
            raw = client.responses.with_raw_response.create(**kwargs)
            body = raw.http_response.json()
            return Response.model_validate(body), body
        with client.responses.with_streaming_response.create(stream=True, **kwargs) as raw:
            events = _sse(raw.iter_lines())
        typed = _validated(events)
        final = typed[-1].response
        added = [e.item.id for e in typed if e.type == "response.output_item.added"]
        done = [e.item.id for e in typed if e.type == "response.output_item.done"]
        assert added == done == [o.id for o in final.output]
        return final, events[-1][1]["response"]

    def agent(task):
        root = task.base_url.rsplit("/e/", 1)[0] + "/v1"
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c, \
                openai.OpenAI(base_url=root, api_key=task.api_key, max_retries=0) as bare:
            items = list(task.messages)
            first, body = ask(c, items)
            got["first"] = body
            (call,) = first.output
            items += [o.model_dump(exclude_none=True) for o in first.output]
            items.append({"type": "function_call_output", "call_id": call.call_id,
                          "output": run_tool(call.name, json.loads(call.arguments))})
            second, got["second"] = ask(bare, items)
            got["text"] = second.output_text

    (ge,), counts = _rollout(tokenizer, engine, agent, [_prompt("37*58=", "2146")],
                             params=lambda n: SamplingParams(max_new_tokens=16, stop_token_ids=[1]))
    assert ge.failure is None and ge.ep.status is Status.COMPLETED and ge.rewrites == 0 and ge.ep.turns == 2
    first = got["first"]
    assert first["status"] == "completed" and first["object"] == "response"
    assert first["output"][0]["status"] == "completed" and first["incomplete_details"] is None
    item = first["output"][0]
    assert (item["type"], item["name"], json.loads(item["arguments"])) == ("function_call", "calc", {"expr": "37*58"})
    assert item["call_id"] == ge.calls[0].id
    assert first["tools"] == TOOLS and first["tool_choice"] == "auto" and first["parallel_tool_calls"] is False
    assert first["max_output_tokens"] == 64 and first["temperature"] == 0.7 and first["metadata"] == {"k": "v"}
    (ctx1, g1), (ctx2, g2) = engine.calls
    for body, ctx, g in ((first, ctx1, g1), (got["second"], ctx2, g2)):
        assert body["usage"] == {"input_tokens": len(ctx), "output_tokens": len(g.token_ids),
                                 "total_tokens": len(ctx) + len(g.token_ids),
                                 "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                                 "output_tokens_details": {"reasoning_tokens": 0}}
    assert got["text"] == "answer: 2146" and got["second"]["output"][0]["type"] == "message"
    assert _check_record(ge.ep, engine.calls) == 2
    loop = AgentLoop(ExpertEngine(tokenizer, env.expert), tokenizer, lambda: CalculatorEnv(system_prompt=None),
                     lambda n: SamplingParams(max_new_tokens=16, stop_token_ids=[tokenizer.eos_token_id]), max_turns=3)
    (ref,) = loop.run([_prompt("37*58=", "2146")])
    assert (ge.ep.prompt_ids, ge.ep.response_ids, ge.ep.loss_mask) == (ref.prompt_ids, ref.response_ids, ref.loss_mask)


def _responses_agent(turns, stream):
    """Asks `turns` times through the openai client's Responses API (a stream read through the client's
    own `responses.stream` helper, which checks each event against the ones before it), sending
    back each answer's output items as the client returned them and then a user message."""
    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as client:
            items = [{"role": "user", "content": [{"type": "input_text", "text": task.messages[-1]["content"]}]}]
            for t in range(turns):
                if stream:
                    with client.responses.stream(model="m", instructions="Be brief.", input=items) as s:
                        # get_final_response() wants response.completed; a turn cut at the budget ends incomplete
                        r = [e.response for e in s if e.type in ("response.completed", "response.incomplete")][-1]
                else:
                    r = client.responses.create(model="m", instructions="Be brief.", input=items)
                items += [o.model_dump(exclude_none=True) for o in r.output]
                items.append({"role": "user", "content": f"more {t}"})
    return agent


def _chat_agent(turns):
    """The same conversation through Chat Completions."""
    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as client:
            messages = [{"role": "system", "content": "Be brief."}, *task.messages]
            for t in range(turns):
                m = client.chat.completions.create(model="m", messages=messages).choices[0].message
                messages += [{"role": "assistant", "content": m.content}, {"role": "user", "content": f"more {t}"}]
    return agent


@pytest.mark.parametrize("stream", [False, True])
def test_responses_turns_are_the_engines_ids_exactly(tokenizer, tiny_model, stream):
    """Three turns of the real tiny engine through /v1/responses: every action is the engine's answer as
    produced (ids, log-probs, versions), each later request extends the record (no new segment), and the
    episode is token for token the same conversation's through /v1/chat/completions (greedy)."""
    engine = Recorder(LocalEngine(tiny_model))
    (ge,), _ = _rollout(tokenizer, engine, _responses_agent(3, stream), [_prompt()])
    assert ge.failure is None and ge.rewrites == 0 and ge.ep.turns == 3
    assert _check_record(ge.ep, engine.calls) == 3
    (chat,), _ = _rollout(tokenizer, LocalEngine(tiny_model), _chat_agent(3), [_prompt()])
    assert chat.rewrites == 0
    assert (ge.ep.prompt_ids, ge.ep.response_ids, ge.ep.loss_mask, ge.ep.logprobs) == \
        (chat.ep.prompt_ids, chat.ep.response_ids, chat.ep.loss_mask, chat.ep.logprobs)


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_cut_at_the_budget_is_incomplete(tokenizer, stream):
    """A turn cut at max_output_tokens is `status: incomplete` with `incomplete_details.reason:
    max_output_tokens`, its items incomplete, and a stream ends with response.incomplete; the turn is
    trained on as produced."""
    engine, _ = _calculator(tokenizer)
    got = {}

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            kwargs = dict(model="m", input=task.messages[-1]["content"], max_output_tokens=3)
            if stream:
                with c.responses.with_streaming_response.create(stream=True, **kwargs) as raw:
                    typed = _validated(_sse(raw.iter_lines()))
                got["last"] = typed[-1].type
                got["r"] = typed[-1].response
            else:
                got["r"] = Response.model_validate(c.responses.with_raw_response.create(**kwargs).http_response.json())

    (ge,), _ = _rollout(tokenizer, engine, agent, [_prompt("37*58=", "2146")],
                        params=lambda n: SamplingParams(max_new_tokens=16, stop_token_ids=[1]))
    r = got["r"]
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.completed_at is None
    assert r.output[0].status == "incomplete" and r.output_text == "cal" and r.usage.output_tokens == 3
    assert got.get("last", "response.incomplete") == "response.incomplete"
    assert ge.ep.status is Status.COMPLETED and ge.ep.loss_mask == [1, 1, 1]


@pytest.mark.parametrize("body, message", [
    ({"input": []}, "input must be a string or a non-empty list of input items"),
    ({"input": "hi", "previous_response_id": "resp_1"},
     "previous_response_id is not supported: the gateway keeps no responses; send the whole conversation in input"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation is not supported"),
    ({"input": "hi", "background": True}, "background responses are not supported"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice='required' needs tools: the request declares none"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "calc"}},
     "a tool_choice that names a function needs tools"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice names the function 'nope', which is not among the request's tools (calc, est)"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "calc"}}},
     "tool_choice={'type': 'function', 'function': {'name': 'calc'}} is not supported: auto, none, required, "
     "{type: function, name} or {type: allowed_tools, mode, tools}"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "web_search_preview"}},
     "tool_choice={'type': 'web_search_preview'} is not supported"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "required",
                                                     "tools": [{"type": "function", "name": "nope"}]}},
     "tool_choice names the function 'nope', which is not among the request's tools (calc, est)"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "any",
                                                     "tools": [{"type": "function", "name": "calc"}]}},
     "tool_choice.mode must be auto or required, got 'any'"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                                     "tools": [{"type": "mcp", "server_label": "x"}]}},
     "tool_choice.tools[0]: only function tools ({type: function, name}) can be allowed, got 'mcp'"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
     "tool_choice.tools must be a non-empty list"),
    ({"input": [{"role": "user", "content": "2*3?"}, {"role": "assistant", "content": "calc:"}], "tools": TOOLS,
      "tool_choice": "required"},
     "an assistant message to continue (prefill) cannot be combined with a forced tool_choice"),
    ({"input": [{"role": "user", "content": "2*3?"},
                {"type": "function_call", "name": "calc", "call_id": "c", "arguments": "{}"}]},
     "the request ends with an assistant message with tool calls"),
    ({"input": "hi", "tools": [{"type": "function", "name": "calc", "parameters": {"type": "objectt"},
                                "strict": True}]}, "tools[0]: strict: true needs a valid JSON schema"),
    ({"input": "hi", "tools": [{"type": "function", "name": "calc", "parameters": {}, "strict": "yes"}]},
     "tools[0].strict must be true or false, got 'yes'"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]: only function tools"),
    ({"input": "hi", "tools": [{"type": "function", "function": {"name": "calc"}}]}, "tools[0]: only function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]: only text parts (input_text, output_text) are supported, got 'input_image'"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0]: reasoning items are not supported"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]: item references are not supported"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0]: role must be one of"),
    ({"input": [{"type": "function_call", "name": "calc", "call_id": "c", "arguments": "{"}]},
     "input[0].arguments is not valid JSON"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
     "text.format is not supported (only type text)"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "logprobs are not returned"),
    ({"input": "hi", "top_logprobs": 3}, "logprobs are not returned"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens must be a positive integer, got 0"),
    ({"input": "hi", "temperature": 3}, "temperature must be a number in [0.0, 2.0], got 3"),
    ({"input": "hi", "instructions": [{"role": "system", "content": "x"}]}, "instructions must be a string"),
])
def test_refused_requests_name_what_is_refused(body, message):
    with pytest.raises(WireError) as e:
        responses_wire.parse_request(body)
    assert e.value.status == 400 and e.value.message.startswith(message), e.value.message


def test_consecutive_assistant_message_items_are_one_message():
    """An assistant message item right after another (a prefill, then the answer's output items as the client
    appends them) joins it: one assistant message, their texts in order; a function_call after them joins
    the same message."""
    req = responses_wire.parse_request({"input": [
        {"role": "user", "content": "2*3?"}, {"role": "assistant", "content": "It is"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": " 6"}]},
        {"type": "function_call", "call_id": "c1", "name": "calc", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "6"},
        {"role": "assistant", "content": "Yes"}, {"role": "user", "content": "ok"}]})
    assert req.messages == [Message("user", "2*3?"), Message("assistant", "It is 6", [ToolCall("c1", "calc", {})]),
                            Message("tool", "6", tool_call_id="c1"), Message("assistant", "Yes"),
                            Message("user", "ok")]
    assert req.prefill is None


def test_input_items_become_the_shared_conversation():
    """instructions first as a system turn; developer as system; a function_call joins the assistant message
    before it (one answer: its text and calls); a function_call without one opens an assistant turn;
    function_call_output is a tool turn; ignored fields stay ignored."""
    req = responses_wire.parse_request({
        "model": "m", "instructions": "Be brief.", "store": False, "parallel_tool_calls": True, "truncation": "auto",
        "reasoning": {"effort": "low"}, "include": ["reasoning.encrypted_content"],
        "text": {"format": {"type": "text"}, "verbosity": "low"},
        "tools": TOOLS, "tool_choice": "none", "max_output_tokens": 5, "top_p": 0.5, "stream": True,
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "input_text", "text": "2*3"}, {"type": "input_text", "text": "="}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "let me see", "annotations": [], "logprobs": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "calc", "arguments": '{"expr": "2*3"}',
             "status": "completed"},
            {"type": "function_call_output", "call_id": "c1", "output": "= 6"},
            {"type": "function_call", "call_id": "c2", "name": "est", "arguments": '{"expr": "2*3"}'},
            {"type": "function_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "~ 6"}]},
        ]})
    assert req.messages == [
        Message("system", "Be brief."), Message("system", "Use tools."), Message("user", "2*3="),
        Message("assistant", "let me see", [ToolCall("c1", "calc", {"expr": "2*3"})]),
        Message("tool", "= 6", tool_call_id="c1"), Message("assistant", "", [ToolCall("c2", "est", {"expr": "2*3"})]),
        Message("tool", "~ 6", tool_call_id="c2")]
    assert [t.name for t in req.tools] == ["calc", "est"] and req.tool_choice == "none"
    assert (req.max_tokens, req.top_p, req.temperature, req.stream) == (5, 0.5, None, True)
    assert responses_wire.parse_request({"input": "hi"}).messages == [Message("user", "hi")]


def test_a_refused_request_is_a_400_in_the_wire_form_and_fails_the_episode(tokenizer, tiny_model):
    got = {}

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            try:
                c.responses.create(model="m", input="hi", previous_response_id="resp_episode-0_1")
            except openai.BadRequestError as e:
                got["bad"] = (e.status_code, e.body, e.response.headers.get("x-should-retry"))

    (ge,), _ = _rollout(tokenizer, LocalEngine(tiny_model), agent, [_prompt()], params=_greedy)
    status, body, retry = got["bad"]
    assert status == 400 and retry == "false" and body["type"] == "invalid_request_error"
    assert body["message"].startswith("previous_response_id is not supported")
    assert ge.ep.status is Status.FAILED and ge.failure[0] == "bad_request"


# ----------------------------------------------------------------- a final assistant message continued (prefill)
@pytest.mark.parametrize("name", ["tiny", "smollm2", "glm45"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_final_assistant_message_is_continued_as_on_the_other_wires(name, stream):
    """`input` ending with an assistant message: the model continues it (the context is the template's
    rendering with that message open, as on the Chat Completions and Messages wires), the answer's message
    item holds only the continuation, and the prefill is context. The client appends the output items after
    its prefill item (consecutive assistant message items are one message), then a user turn and a new
    prefill: the record extends, and each context is the template's rendering with its last message open."""
    tok = TOKENIZERS[name]()
    answers = [(_ids(tok, " 6") + [end_token(name, tok, "user")], "stop"),
               (_ids(tok, " 12") + [end_token(name, tok, "user")], "stop")]
    got = []

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            items = list(task.messages)
            for prefill, follow in (("It is", "Double it?"), ("That is", None)):
                items.append({"role": "assistant", "content": prefill})
                if stream:
                    with c.responses.with_streaming_response.create(model="m", input=items, stream=True) as raw:
                        r = _validated(_sse(raw.iter_lines()))[-1].response
                else:
                    r = Response.model_validate(
                        c.responses.with_raw_response.create(model="m", input=items).http_response.json())
                got.append((r.status, [o.type for o in r.output], r.output_text))
                items += [o.model_dump(exclude_none=True) for o in r.output]
                if follow:
                    items.append({"role": "user", "content": follow})

    ge, engine, _ = _scripted(tok, answers, agent)
    conversation = [{"role": "user", "content": "2*3?"}, {"role": "assistant", "content": "It is"}]
    first = _open(tok, conversation)
    assert engine.contexts[0] == first, f"{tok.decode(engine.contexts[0])!r} != {tok.decode(first)!r}"
    assert ge.ep.status is Status.COMPLETED and ge.rewrites == 0 and ge.ep.turns == 2, ge.failure
    assert got == [("completed", ["message"], " 6"), ("completed", ["message"], " 12")]
    conversation[1]["content"] = "It is 6"
    conversation += [{"role": "user", "content": "Double it?"}, {"role": "assistant", "content": "That is"}]
    second = _open(tok, conversation)
    assert engine.contexts[1] == second, f"{tok.decode(engine.contexts[1])!r} != {tok.decode(second)!r}"
    ep = ge.ep
    for ctx, (ids, _), prefill in zip(engine.contexts, answers, ("It is", "That is")):
        at = len(ctx) - len(ep.prompt_ids)
        n = len(_ids(tok, prefill))
        assert ep.loss_mask[at:at + len(ids)] == [1] * len(ids) and ep.response_ids[at:at + len(ids)] == ids
        assert at <= 0 or ep.loss_mask[at - n:at] == [0] * n  # the prefill: context


def test_a_cut_answer_sent_back_continues_in_place():
    """A turn cut at max_output_tokens (`status: incomplete`), its output items sent back as they came: the
    final assistant message is the cut answer, so the engine continues the record as it is, and the two parts
    are one action in one segment."""
    tok = TOKENIZERS["tiny"]()
    answers = [(_ids(tok, "calc: 37"), "length"), (_ids(tok, "*58") + [tok.eos_token_id], "stop")]
    got = []

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            items = list(task.messages)
            for _ in range(2):
                r = c.responses.create(model="m", input=items, max_output_tokens=8)
                got.append((r.status, r.output_text))
                items += [o.model_dump(exclude_none=True) for o in r.output]

    ge, engine, _ = _scripted(tok, answers, agent)
    assert got == [("incomplete", "calc: 37"), ("completed", "*58")]
    assert ge.ep.status is Status.COMPLETED and ge.rewrites == 0 and not ge.ep.segments
    assert engine.contexts[1] == engine.contexts[0] + answers[0][0]
    assert ge.ep.response_ids == answers[0][0] + answers[1][0] and set(ge.ep.loss_mask) == {1}
    assert ge.final_text == "calc: 37*58"


# ----------------------------------------------------------------- strict tools
def test_a_strict_tool_gets_only_calls_that_conform():
    """A function tool with `strict: true` (the Agents SDK's default): a call whose arguments do not conform to
    its schema is answered as text (a message item, no function_call), as an unparseable call is, and
    counted; with `strict: false` the same call is returned; the answer repeats each tool's `strict`."""
    tok = TOKENIZERS["tiny"]()
    strict = {"type": "function", "name": "calc", "description": "exact value", "strict": True, "parameters": {
        "type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"],
        "additionalProperties": False}}
    loose = {**strict, "strict": False}
    bad = 'calc: {"expr": "2*3", "extra": 1}'
    answers = [(_ids(tok, bad) + [tok.eos_token_id], "stop"), (_ids(tok, bad) + [tok.eos_token_id], "stop"),
               (_ids(tok, "calc: 2*3") + [tok.eos_token_id], "stop")]
    got = []

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            for tool in (strict, loose, strict):
                body = c.responses.with_raw_response.create(model="m", input=task.messages,
                                                            tools=[tool]).http_response.json()
                r = Response.model_validate(body)
                got.append((body["tools"][0]["strict"], r.output_text,
                            [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]))

    ge, _, counts = _scripted(tok, answers, agent)
    assert got == [(True, bad, []), (False, "", [("calc", {"expr": "2*3", "extra": 1})]),
                   (True, "", [("calc", {"expr": "2*3"})])]
    assert counts["gateway_strict_mismatch"] == 1 and ge.ep.status is Status.COMPLETED
