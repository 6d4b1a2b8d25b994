"""The agent gateway's wires beyond a turn, driven by the official `openai` and `anthropic` clients: every
error in the wire's own form (unknown routes and methods included), Anthropic's token count, one model's
record, an assistant message at the end of a request continued (prefill) token for token, and the request
fields the gateway honours (`strict` schemas, `tool_result.is_error`) or refuses (the legacy `functions`,
a message without content)."""

import json
from collections import Counter

import anthropic
import httpx
import openai
import pytest

from glmlight.prompt import Prompt
from glmlight.engines.base import SamplingParams
from glmlight.gateway.runner import GatewayOptions, GatewayRollout
from glmlight.models.tokenizer import encode_chat, stop_token_ids
from glmlight.sample import Status
from tests.support.chat_templates import ANSWER_PREFIX, TOKENIZERS, end_token
from tests.support.scripted_engine import ScriptedEngine

CALC = {"type": "function", "function": {"name": "calc", "description": "exact value", "parameters": {
    "type": "object", "properties": {"expr": {"type": "string"}}}}}


def _rollout(tok, answers, agent, max_context=2048):
    engine = ScriptedEngine(answers)
    counts = Counter()
    params = lambda n: SamplingParams(max_new_tokens=64, stop_token_ids=stop_token_ids(tok))  # noqa: E731
    (ge,) = GatewayRollout(engine, tok, GatewayOptions(agent=agent), params, 6, max_context, counts).run(
        [Prompt(messages=[{"role": "user", "content": "2*3?"}])])
    return ge, engine, counts


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _open(tok, conversation):
    """The template's rendering of `conversation` with its last (assistant) message left open."""
    out = tok.apply_chat_template(conversation, add_generation_prompt=False, continue_final_message=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _root(task):
    return task.base_url.rsplit("/e/", 1)[0]


# ----------------------------------------------------------------- errors in the wire's own form, routes
def test_unknown_routes_and_methods_get_the_wires_error_form():
    """An unknown path, a known path with another method: a 404 / 405 in OpenAI's error form, or Anthropic's
    under /v1/messages, with `x-should-retry: false` (before: aiohttp's plain text, which the clients
    cannot read and would retry)."""
    tok = TOKENIZERS["tiny"]()
    got = {}

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            for name, method, path in (("unknown", "post", "/no/such/route"), ("method", "get", "/chat/completions")):
                try:
                    getattr(c, method)(path, cast_to=object, **({"body": {}} if method == "post" else {}))
                except openai.APIStatusError as e:
                    got[name] = (e.status_code, e.body, e.response.headers.get("x-should-retry"))
        with anthropic.Anthropic(base_url=_root(task), api_key=task.api_key, max_retries=0) as c:
            for name, method, path in (("anthropic_unknown", "get", "/v1/messages/batches"),
                                       ("anthropic_method", "get", "/v1/messages")):
                try:
                    getattr(c, method)(path, cast_to=object)
                except anthropic.APIStatusError as e:
                    got[name] = (e.status_code, e.body, e.response.headers.get("x-should-retry"))
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            c.chat.completions.create(model="m", messages=task.messages)

    ge, _, _ = _rollout(tok, [(_ids(tok, "6") + [tok.eos_token_id], "stop")], agent)
    assert ge.ep.status is Status.COMPLETED  # a route the gateway does not serve does not fail the episode
    status, body, retry = got["unknown"]
    assert (status, retry) == (404, "false") and set(body) == {"message", "type", "param", "code"}, body
    assert body["type"] == "invalid_request_error" and "POST /e/" in body["message"]
    assert "POST /v1/chat/completions" in body["message"], body  # it lists the routes served
    status, body, retry = got["method"]
    assert (status, retry) == (405, "false") and body["type"] == "invalid_request_error"
    assert "GET is not allowed" in body["message"] and "POST" in body["message"], body
    status, body, retry = got["anthropic_unknown"]
    assert (status, retry) == (404, "false") and body == {"type": "error", "error": {
        "type": "not_found_error", "message": body["error"]["message"]}} and "/v1/messages/batches" in str(body)
    status, body, retry = got["anthropic_method"]
    assert (status, retry) == (405, "false") and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and "GET is not allowed" in body["error"]["message"]


def test_count_tokens_is_the_prompt_the_template_renders():
    """`client.messages.count_tokens` (POST /v1/messages/count_tokens): the number of ids the chat template
    renders for the request (system, tools, tool use and results, the assistant opening), the same number
    the turn's usage reports for the same request; a malformed one gets Anthropic's error form and leaves
    the episode as it was."""
    tok = TOKENIZERS["glm45"]()  # a template that renders the tools and the structured calls
    tools = [{"name": "calc", "description": "exact value", "input_schema": CALC["function"]["parameters"]}]
    messages = [{"role": "user", "content": "2*3?"},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "t1", "name": "calc", "input": {"expr": "2*3"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "6"}]}]
    got = {}

    def agent(task):
        with anthropic.Anthropic(base_url=task.anthropic_base_url, api_key=task.api_key, max_retries=0) as c:
            got["count"] = c.messages.count_tokens(model="m", system="Be brief.", messages=messages, tools=tools)
            try:
                c.messages.count_tokens(model="m", messages=[{"role": "wizard", "content": "x"}])
            except anthropic.BadRequestError as e:
                got["bad"] = (e.body, e.response.headers.get("x-should-retry"))
            r = c.messages.create(model="m", max_tokens=8, system="Be brief.", messages=messages, tools=tools)
            got["usage"] = r.usage.input_tokens

    answer = _ids(tok, ANSWER_PREFIX["glm45"] + "6") + [end_token("glm45", tok, "user")]
    ge, engine, _ = _rollout(tok, [(answer, "stop")], agent)
    whole = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2*3?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "calc", "arguments": {"expr": "2*3"}}}]},
             {"role": "tool", "content": "6"}]
    expected = encode_chat(tok, whole, add_generation_prompt=True, tools=[{"type": "function", "function": {
        "name": "calc", "description": "exact value", "parameters": CALC["function"]["parameters"]}}])
    assert got["count"].input_tokens == len(expected) == got["usage"] == len(engine.contexts[0])
    assert got["bad"][0]["type"] == "error" and "role must be user or assistant" in got["bad"][0]["error"]["message"]
    assert got["bad"][1] == "false"
    assert ge.ep.status is Status.COMPLETED and ge.requests == 1


def test_the_models_own_record_and_stream_null():
    """GET /v1/models/{id}: the one model; any other id a 404 in OpenAI's form. `"stream": null` is a
    request that does not stream (OpenAI's spec allows null), on both wires."""
    tok = TOKENIZERS["tiny"]()
    got = {}

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            got["model"] = c.models.retrieve("glmlight").id
            try:
                c.models.retrieve("gpt-4o")
            except openai.NotFoundError as e:
                got["unknown"] = e.body
            got["null"] = c.post("/chat/completions", body={"model": "m", "messages": task.messages, "stream": None},
                                 cast_to=object)["choices"][0]["message"]["content"]
        r = httpx.post(task.base_url + "/v1/messages", json={
            "model": "m", "max_tokens": 8, "messages": task.messages, "stream": None})
        got["anthropic_null"] = (r.status_code, r.json()["content"][0]["text"])

    ge, _, _ = _rollout(tok, [(_ids(tok, t) + [tok.eos_token_id], "stop") for t in ("6", "7")], agent)
    assert got["model"] == "glmlight"
    assert got["unknown"]["type"] == "invalid_request_error" and got["unknown"]["code"] == "model_not_found"
    assert "'gpt-4o'" in got["unknown"]["message"] and "'glmlight'" in got["unknown"]["message"]
    assert got["null"] == "6" and got["anthropic_null"] == (200, "7")
    assert ge.ep.status is Status.COMPLETED


# ----------------------------------------------------------------- an assistant message continued (prefill)
@pytest.mark.parametrize("name", ["tiny", "smollm2", "glm45"])
def test_a_final_assistant_message_is_continued_not_answered_anew(name):
    """Anthropic's prefill: the model continues the final assistant message (the context is the template's
    rendering with that message open, not closed and followed by a new assistant turn); the answer holds
    only the continuation; the prefill is context (loss mask 0), the continuation the action. The client
    sends the whole message back with a user turn and a new prefill: the record extends, and each context is
    the template's rendering of the conversation with its last message open."""
    tok = TOKENIZERS[name]()
    answers = [(_ids(tok, " 6") + [end_token(name, tok, "user")], "stop"),
               (_ids(tok, " 12") + [end_token(name, tok, "user")], "stop")]
    got = []

    def agent(task):
        with anthropic.Anthropic(base_url=task.anthropic_base_url, api_key=task.api_key, max_retries=0) as c:
            msgs = list(task.messages)
            for prefill, follow in (("It is", "Double it?"), ("That is", None)):
                r = c.messages.create(model="m", max_tokens=32,
                                      messages=msgs + [{"role": "assistant", "content": prefill}])
                got.append(r.content[0].text)
                msgs += [{"role": "assistant", "content": prefill + r.content[0].text}]
                if follow:
                    msgs.append({"role": "user", "content": follow})

    ge, engine, counts = _rollout(tok, answers, agent)
    conversation = [{"role": "user", "content": "2*3?"}, {"role": "assistant", "content": "It is"}]
    first = _open(tok, conversation)
    assert engine.contexts[0] == first, f"{tok.decode(engine.contexts[0])!r} != {tok.decode(first)!r}"
    assert ge.ep.status is Status.COMPLETED and ge.rewrites == 0 and ge.ep.turns == 2, ge.failure
    assert got == [" 6", " 12"]
    conversation[1]["content"] = "It is 6"
    conversation += [{"role": "user", "content": "Double it?"}, {"role": "assistant", "content": "That is"}]
    second = _open(tok, conversation)
    assert engine.contexts[1] == second, f"{tok.decode(engine.contexts[1])!r} != {tok.decode(second)!r}"
    ep = ge.ep
    for ctx, (ids, _) in zip(engine.contexts, answers):
        at = len(ctx) - len(ep.prompt_ids)
        n = len(_ids(tok, "That is" if at > 0 else "It is"))
        assert ep.loss_mask[at:at + len(ids)] == [1] * len(ids) and ep.response_ids[at:at + len(ids)] == ids
        assert at <= 0 or ep.loss_mask[at - n:at] == [0] * n  # the prefill: context


def test_a_cut_answer_sent_back_as_the_prefill_continues_in_place():
    """A turn cut by max_tokens, sent back as the final assistant message to continue (Anthropic's way of
    asking for more): the engine continues the record as it is, so the turn's two parts are one action
    in one segment; the OpenAI wire does the same."""
    tok = TOKENIZERS["tiny"]()
    answers = [(_ids(tok, "calc: 37"), "length"), (_ids(tok, "*58") + [tok.eos_token_id], "stop")]
    got = []

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            r = c.chat.completions.create(model="m", messages=task.messages, max_tokens=8)
            got.append((r.choices[0].finish_reason, r.choices[0].message.content))
            r = c.chat.completions.create(model="m", messages=task.messages + [
                {"role": "assistant", "content": got[0][1]}])
            got.append((r.choices[0].finish_reason, r.choices[0].message.content))

    ge, engine, _ = _rollout(tok, answers, agent)
    assert got == [("length", "calc: 37"), ("stop", "*58")]
    assert ge.ep.status is Status.COMPLETED and ge.rewrites == 0 and not ge.ep.segments
    assert engine.contexts[1] == engine.contexts[0] + answers[0][0]
    assert ge.ep.response_ids == answers[0][0] + answers[1][0] and set(ge.ep.loss_mask) == {1}
    assert ge.final_text == "calc: 37*58"


def test_a_final_assistant_message_with_tool_calls_is_refused():
    from glmlight.gateway import openai_wire
    from glmlight.gateway.messages import WireError

    with pytest.raises(WireError, match="ends with an assistant message with tool calls"):
        openai_wire.parse_request({"messages": [{"role": "user", "content": "x"}, {
            "role": "assistant", "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "calc", "arguments": "{}"}}]}]})


# ----------------------------------------------------------------- request fields honoured or refused
def test_a_strict_schema_gets_only_calls_that_conform():
    """`strict: true` (OpenAI's structured function calls, the OpenAI Agents SDK's default): the agent gets a
    call only when its arguments conform to the schema; a call that does not is answered as text, as an
    unparseable call is, and counted. Without `strict` the same call is returned."""
    tok = TOKENIZERS["tiny"]()
    strict = {"type": "function", "function": {**CALC["function"], "strict": True, "parameters": {
        "type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"],
        "additionalProperties": False}}}
    loose = {"type": "function", "function": {**strict["function"], "strict": False}}
    bad = 'calc: {"expr": "2*3", "extra": 1}'
    answers = [(_ids(tok, bad) + [tok.eos_token_id], "stop"), (_ids(tok, bad) + [tok.eos_token_id], "stop"),
               (_ids(tok, "calc: 2*3") + [tok.eos_token_id], "stop")]
    got = []

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            for tools in ([strict], [loose], [strict]):
                m = c.chat.completions.create(model="m", messages=task.messages, tools=tools).choices[0].message
                calls = [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or []]
                got.append((m.content, calls))

    ge, _, counts = _rollout(tok, answers, agent)
    assert got == [(bad, []), (None, [("calc", {"expr": "2*3", "extra": 1})]), (None, [("calc", {"expr": "2*3"})])]
    assert counts["gateway_strict_mismatch"] == 1 and ge.ep.status is Status.COMPLETED


def test_a_tool_result_marked_as_an_error_is_rendered_as_one():
    """Anthropic's `tool_result.is_error: true`: the tool turn the model reads says so ("Error: ..."), so the
    policy can tell a failed tool from a result."""
    tok = TOKENIZERS["tiny"]()
    answers = [(_ids(tok, t) + [tok.eos_token_id], "stop") for t in ("calc: 2*", "calc: 2*3")]
    tools = [{"name": "calc", "description": "exact value", "input_schema": CALC["function"]["parameters"]}]

    def agent(task):
        with anthropic.Anthropic(base_url=task.anthropic_base_url, api_key=task.api_key, max_retries=0) as c:
            r = c.messages.create(model="m", max_tokens=16, messages=task.messages, tools=tools)
            use = r.content[0]
            c.messages.create(model="m", max_tokens=16, tools=tools, messages=task.messages + [
                {"role": "assistant", "content": [use.model_dump()]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "is_error": True,
                                              "content": "cannot parse '2*'"}]}])

    ge, engine, _ = _rollout(tok, answers, agent)
    assert ge.ep.status is Status.COMPLETED and ge.rewrites == 0
    assert tok.decode(engine.contexts[1]).endswith("<|observation|>Error: cannot parse '2*'<|assistant|>")


@pytest.mark.parametrize("wire, body, needle", [
    ("openai", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "calc", "parameters": {}}]},
     "functions / function_call are the legacy form of tools / tool_choice and are not supported: send tools"),
    ("openai", {"messages": [{"role": "user", "content": "x"}], "function_call": "auto"},
     "functions / function_call are the legacy form of tools / tool_choice and are not supported"),
    ("openai", {"messages": [{"role": "user", "content": "x"}, {
        "role": "assistant", "content": None, "function_call": {"name": "calc", "arguments": "{}"}}]},
     "messages[1].function_call is the legacy form of tool_calls and is not supported"),
    ("openai", {"messages": [{"role": "user"}]}, "messages[0]: a user message needs its content"),
    ("openai", {"messages": [{"role": "user", "content": None}]}, "messages[0]: a user message needs its content"),
    ("openai", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]},
     "messages[1]: an assistant message needs its content or its tool_calls"),
    ("anthropic", {"messages": [{"role": "user", "content": []}], "max_tokens": 8},
     "messages[0]: a user message needs at least one content block"),
    ("openai", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream must be true, false or null"),
])
def test_fields_the_gateway_does_not_serve_are_refused_with_a_400_that_names_them(wire, body, needle):
    import importlib

    from glmlight.gateway.messages import WireError

    parse = importlib.import_module(f"glmlight.gateway.{wire}_wire").parse_request
    with pytest.raises(WireError) as e:
        parse(body)
    assert e.value.status == 400 and needle in e.value.message, e.value.message
