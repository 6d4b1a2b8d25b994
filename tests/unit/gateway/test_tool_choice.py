"""A forced `tool_choice` through the agent gateway: OpenAI's `required` and a named function (Chat
Completions' `{type: function, function: {name}}`, the Responses API's `{type: function, name}` and its
`allowed_tools`), Anthropic's `any` and `tool`. The opening of the template's tool-call format (and for a
named function its name) is appended to the turn's context as forced tokens, context and not action; the
model samples the rest. Under each chat template the episode stays the template's rendering of the
conversation token for token, the agent gets a structured call, an answer that is no call is answered as
text and counted, and the trainer scores the sampled tokens at the engine's own log-probs. A named
function's call finishes with "stop" on Chat Completions, as OpenAI answers it."""

import json
import os
from collections import Counter

import anthropic
import openai
import pytest
from openai.types.responses import Response
from tokenizers import AddedToken

from glmlight.algorithms.grpo import GRPO, GRPOConfig
from glmlight.config.rollout import RolloutConfig
from glmlight.agents.options import AgentOptions
from glmlight.data.rollout import RolloutDataModule
from glmlight.data.sources import ArithmeticTask
from glmlight.prompt import Prompt
from glmlight.engines.base import SamplingParams
from glmlight.engines.local.engine import LocalEngine
from glmlight.gateway.runner import GatewayOptions, GatewayRollout
from glmlight.models.tokenizer import build_char_tokenizer, encode_chat, stop_token_ids
from glmlight.sample import Status
from tests.support.chat_templates import ANSWER_PREFIX, TOKENIZERS, end_token
from tests.support.scripted_engine import ScriptedEngine
from tests.support.tolerances import model_logprob_tolerance
from tests.unit.gateway.test_gateway_formats import HERMES_TEMPLATE


def _tool(name):
    schema = {"type": "object", "properties": {"expr": {"type": "string"}}}
    return {"type": "function", "function": {"name": name, "description": f"{name} of an expression",
                                             "parameters": schema}}


TOOLS = [_tool("calc"), _tool("est")]


def _hermes_tokenizer():
    tok = build_char_tokenizer()
    tok.chat_template = HERMES_TEMPLATE
    return tok


def _qwen25_tokenizer():
    """Qwen2.5's template (read from the `trl` package, a dev extra): tool calls as `<tool_call>` blocks of
    JSON on lines of their own."""
    import trl

    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]})
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")])
    tok.eos_token = "<|im_end|>"
    with open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen2_5.jinja")) as f:
        tok.chat_template = f.read()
    return tok


TEMPLATES = {**TOKENIZERS, "hermes": _hermes_tokenizer, "qwen25": _qwen25_tokenizer}

# What the template's tool-call format opens a call with (the forced tokens): for a named function through
# its name, for `required` (several tools) up to the name. glmlight's line format has no opening of its own.
OPENING = {"tiny": ("calc:", ""), "smollm2": ("calc:", ""),
           "glm45": ("\n<think></think>\n<tool_call>calc", "\n<think></think>\n<tool_call>"),
           "hermes": ('<tool_call>{"name": "calc", "arguments":', '<tool_call>{"name": "'),
           "qwen25": ('<tool_call>\n{"name": "calc", "arguments":', '<tool_call>\n{"name": "')}
# The rest of each call, as the model samples it.
REST = {"tiny": (" 2*3", "est: 2*3"), "smollm2": (" 2*3", "est: 2*3"),
        "glm45": ("\n<arg_key>expr</arg_key>\n<arg_value>2*3</arg_value>\n</tool_call>",
                  "est\n<arg_key>expr</arg_key>\n<arg_value>2*3</arg_value>\n</tool_call>"),
        "hermes": (' {"expr": "2*3"}}</tool_call>', 'est", "arguments": {"expr": "2*3"}}</tool_call>'),
        "qwen25": (' {"expr": "2*3"}}\n</tool_call>', 'est", "arguments": {"expr": "2*3"}}\n</tool_call>')}


def _call_turn(name, tool):
    if name in ("glm45", "hermes", "qwen25"):  # the template renders the structured call itself
        return {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": tool, "arguments": {"expr": "2*3"}}}]}
    return {"role": "assistant", "content": f"{tool}: 2*3"}


def _tool_turn(name, text):
    return {"role": "tool" if name in ("glm45", "hermes", "qwen25") else "observation", "content": text}


def _end(name, tok, following):
    return tok.eos_token_id if name in ("hermes", "qwen25") else end_token(name, tok, following)


@pytest.mark.parametrize("name", ["tiny", "smollm2", "glm45", "hermes", "qwen25"])
def test_forced_calls_are_the_templates_rendering_turn_by_turn(name):
    """Turn 1 names `calc`, turn 2 requires a call (two tools), turn 3 is free: each context the engine
    continues is the template's rendering of the conversation, then the forced opening; the agent gets the
    structured calls; the whole record is the template's rendering of the whole conversation; the forced
    tokens are context (loss mask 0, log-prob 0), the sampled ones the actions."""
    tok = TEMPLATES[name]()
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prefix = ANSWER_PREFIX.get(name, "")
    engine = ScriptedEngine([(ids(REST[name][0]) + [_end(name, tok, "tool")], "stop"),
                             (ids(REST[name][1]) + [_end(name, tok, "tool")], "stop"),
                             (ids(prefix + "It is 6.") + [_end(name, tok, "user")], "stop")])
    seen = []

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            msgs = list(task.messages)
            for choice, result in (({"type": "function", "function": {"name": "calc"}}, "6"), ("required", "~ 6"),
                                   ("auto", None)):
                r = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, tool_choice=choice)
                m = r.choices[0].message
                seen.append((r.choices[0].finish_reason, m.content,
                             [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or []]))
                msgs.append(m.model_dump(exclude_none=True))
                if m.tool_calls:
                    msgs.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": result})

    params = lambda n: SamplingParams(max_new_tokens=64, stop_token_ids=stop_token_ids(tok))  # noqa: E731
    counts = Counter()
    (ge,) = GatewayRollout(engine, tok, GatewayOptions(agent=agent), params, 4, 2048, counts).run(
        [Prompt(messages=[{"role": "user", "content": "2*3?"}])])
    assert ge.ep.status is Status.COMPLETED and ge.rewrites == 0 and ge.ep.turns == 3, ge.failure
    # a named function's call finishes with "stop", as OpenAI answers it; required's with "tool_calls"
    assert seen[0][0] == "stop" and seen[0][2] == [("calc", {"expr": "2*3"})]
    assert seen[1][0] == "tool_calls" and seen[1][2] == [("est", {"expr": "2*3"})]
    assert seen[2][2] == [] and seen[2][1].endswith("It is 6.")
    assert counts["gateway_forced_calls"] == 2 and counts["gateway_forced_unparsed"] == 0
    conversation = [{"role": "user", "content": "2*3?"}, _call_turn(name, "calc"), _tool_turn(name, "6"),
                    _call_turn(name, "est"), _tool_turn(name, "~ 6")]
    for ctx, upto, opening in zip(engine.contexts, (1, 3, 5), (*OPENING[name], "")):
        expected = encode_chat(tok, conversation[:upto], add_generation_prompt=True, tools=TOOLS) + ids(opening)
        assert ctx == expected, f"context:  {tok.decode(ctx)!r}\nexpected: {tok.decode(expected)!r}"
    ep = ge.ep
    assert ep.context[:len(engine.contexts[-1])] == engine.contexts[-1]
    for ctx, opening in zip(engine.contexts[:2], OPENING[name]):  # forced: masked, no log-prob of their own
        at = len(ctx) - len(ep.prompt_ids)
        n = len(ids(opening))
        assert ep.context[:len(ctx)] == ctx and ep.loss_mask[at - n:at] == [0] * n
        assert ep.logprobs[at - n:at] == [0.0] * n and ep.versions[at - n:at] == [-1] * n
        assert ep.loss_mask[at] == 1


@pytest.mark.parametrize("name", ["tiny", "glm45"])
def test_anthropic_tool_and_any_force_a_call(name):
    """Anthropic's `{"type": "tool", "name": ...}` and `{"type": "any"}` are a named function and `required`."""
    tok = TEMPLATES[name]()
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    engine = ScriptedEngine([(ids(REST[name][0]) + [_end(name, tok, "tool")], "stop"),
                             (ids(REST[name][1]) + [_end(name, tok, "tool")], "stop")])
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    seen = []

    def agent(task):
        with anthropic.Anthropic(base_url=task.anthropic_base_url, api_key=task.api_key, max_retries=0) as c:
            msgs = list(task.messages)
            for choice in ({"type": "tool", "name": "calc"}, {"type": "any"}):
                r = c.messages.create(model="m", max_tokens=64, messages=msgs, tools=tools, tool_choice=choice)
                seen.append((r.stop_reason, [(b.name, b.input) for b in r.content if b.type == "tool_use"]))
                use = next(b for b in r.content if b.type == "tool_use")
                msgs += [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "6"}]}]

    params = lambda n: SamplingParams(max_new_tokens=64, stop_token_ids=stop_token_ids(tok))  # noqa: E731
    (ge,) = GatewayRollout(engine, tok, GatewayOptions(agent=agent), params, 4, 2048, Counter()).run(
        [Prompt(messages=[{"role": "user", "content": "2*3?"}])])
    assert ge.ep.status is Status.COMPLETED and ge.rewrites == 0, ge.failure
    assert seen == [("tool_use", [("calc", {"expr": "2*3"})]), ("tool_use", [("est", {"expr": "2*3"})])]
    assert engine.contexts[0][-len(ids(OPENING[name][0])):] == ids(OPENING[name][0])


def test_a_forced_turn_that_is_no_call_is_answered_as_text_and_counted():
    """The model's continuation of a forced opening does not parse as a call: the answer is its text (the
    forced opening and the sampled rest), as any unparseable call is answered, and it is counted."""
    tok = _hermes_tokenizer()
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    engine = ScriptedEngine([(ids(" not json") + [tok.eos_token_id], "stop")])
    seen = {}

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            r = c.chat.completions.create(model="m", messages=task.messages, tools=TOOLS,
                                          tool_choice={"type": "function", "function": {"name": "calc"}})
            seen["answer"] = (r.choices[0].finish_reason, r.choices[0].message.content, r.choices[0].message.tool_calls)

    counts = Counter()
    params = lambda n: SamplingParams(max_new_tokens=64, stop_token_ids=stop_token_ids(tok))  # noqa: E731
    (ge,) = GatewayRollout(engine, tok, GatewayOptions(agent=agent), params, 4, 2048, counts).run(
        [Prompt(messages=[{"role": "user", "content": "2*3?"}])])
    assert ge.ep.status is Status.COMPLETED
    assert seen["answer"] == ("stop", '<tool_call>{"name": "calc", "arguments": not json', None)
    assert counts["gateway_forced_calls"] == 1 and counts["gateway_forced_unparsed"] == 1
    assert ge.ep.info["forced_unparsed"] == 1


@pytest.mark.parametrize("wire, request_kwargs, needle", [
    ("openai", dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice names the function 'nope', which is not among the request's tools (calc, est)"),
    ("openai", dict(tool_choice="required"), "tool_choice='required' needs tools"),
    ("openai", dict(tools=TOOLS, tool_choice="required", prefill=True),
     "an assistant message to continue (prefill) cannot be combined with a forced tool_choice"),
    ("anthropic", dict(tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}),
     "tool_choice names the tool 'nope', which is not among the request's tools (calc, est)"),
    ("anthropic", dict(tool_choice={"type": "any"}), "tool_choice type 'any' needs tools"),
])
def test_forced_choices_the_gateway_cannot_serve_are_refused_in_the_wires_form(wire, request_kwargs, needle):
    from glmlight.gateway import anthropic_wire, openai_wire
    from glmlight.gateway.messages import WireError

    kw = dict(request_kwargs)
    messages = [{"role": "user", "content": "2*3?"}] + ([{"role": "assistant", "content": "calc:"}]
                                                        if kw.pop("prefill", False) else [])
    if wire == "anthropic" and "tools" in kw:
        kw["tools"] = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                       for t in kw["tools"]]
    parse = (openai_wire if wire == "openai" else anthropic_wire).parse_request
    with pytest.raises(WireError) as e:
        parse({"messages": messages, "max_tokens": 8, **kw})
    assert e.value.status == 400 and needle in e.value.message, e.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_functions_call_finishes_with_stop_as_openai_answers_it(stream):
    """Chat Completions: OpenAI answers a call of the function `tool_choice` names with finish_reason "stop"
    (not "tool_calls"); `required` and `auto` calls finish with "tool_calls". Streamed and not, read by the
    openai client as its ChatCompletion / ChatCompletionChunk types."""
    tok = TEMPLATES["tiny"]()
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    engine = ScriptedEngine([(ids(REST["tiny"][0]) + [tok.eos_token_id], "stop"),
                             (ids(REST["tiny"][1]) + [tok.eos_token_id], "stop"),
                             (ids("est: 2*3") + [tok.eos_token_id], "stop")])
    seen = []

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            for choice in ({"type": "function", "function": {"name": "calc"}}, "required", "auto"):
                kw = dict(model="m", messages=task.messages, tools=TOOLS, tool_choice=choice)
                if stream:
                    chunks = list(c.chat.completions.create(stream=True, **kw))
                    calls = [d.function.name for ch in chunks for d in ch.choices[0].delta.tool_calls or []]
                    seen.append(([ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason], calls))
                else:
                    r = c.chat.completions.create(**kw)
                    calls = [t.function.name for t in r.choices[0].message.tool_calls]
                    seen.append(([r.choices[0].finish_reason], calls))

    params = lambda n: SamplingParams(max_new_tokens=64, stop_token_ids=stop_token_ids(tok))  # noqa: E731
    (ge,) = GatewayRollout(engine, tok, GatewayOptions(agent=agent), params, 4, 2048, Counter()).run(
        [Prompt(messages=[{"role": "user", "content": "2*3?"}])])
    assert ge.ep.status is Status.COMPLETED, ge.failure
    assert seen == [(["stop"], ["calc"]), (["tool_calls"], ["est"]), (["tool_calls"], ["est"])]


# ----------------------------------------------------------------- the Responses API's forced tool_choice
def _responses_tools(tools):
    """Chat Completions function tools in the Responses API's flat form."""
    return [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
             "parameters": t["function"]["parameters"], "strict": False} for t in tools]


def _responses_ask(client, stream, **kw):
    """One Responses turn: (the Response as the openai package's type, validated from the raw JSON or from the
    stream's events, each validated too; the raw answer)."""
    from tests.unit.gateway.test_gateway_responses import _sse, _validated

    if not stream:
        body = client.responses.with_raw_response.create(**kw).http_response.json()
        return Response.model_validate(body), body
    with client.responses.with_streaming_response.create(stream=True, **kw) as raw:
        events = _sse(raw.iter_lines())
    return _validated(events)[-1].response, events[-1][1]["response"]


@pytest.mark.parametrize("name", ["tiny", "smollm2", "glm45", "hermes", "qwen25"])
def test_responses_forced_calls_are_the_templates_rendering_turn_by_turn(name):
    """The Responses API's `{"type": "function", "name": ...}` and `"required"`, as the Chat Completions twin
    above: each context the engine continues is the template's rendering of the conversation, then the
    forced opening; the answers are function_call items (validated as the openai package's Response, from
    the JSON and from the stream's events) that repeat the request's tool_choice; the client sends the
    output items back as they came and the record extends; the forced ids are context."""
    tok = TEMPLATES[name]()
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prefix = ANSWER_PREFIX.get(name, "")
    engine = ScriptedEngine([(ids(REST[name][0]) + [_end(name, tok, "tool")], "stop"),
                             (ids(REST[name][1]) + [_end(name, tok, "tool")], "stop"),
                             (ids(prefix + "It is 6.") + [_end(name, tok, "user")], "stop")])
    seen = []

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            items = list(task.messages)
            for choice, result, stream in (({"type": "function", "name": "calc"}, "6", False),
                                           ("required", "~ 6", True), ("auto", None, False)):
                r, body = _responses_ask(c, stream, model="m", input=items, tools=_responses_tools(TOOLS),
                                         tool_choice=choice)
                calls = [o for o in r.output if o.type == "function_call"]
                seen.append((body["tool_choice"], r.status, [(o.name, json.loads(o.arguments)) for o in calls]))
                items += [o.model_dump(exclude_none=True) for o in r.output]
                items += [{"type": "function_call_output", "call_id": o.call_id, "output": result} for o in calls]
            seen.append(r.output_text)

    params = lambda n: SamplingParams(max_new_tokens=64, stop_token_ids=stop_token_ids(tok))  # noqa: E731
    counts = Counter()
    (ge,) = GatewayRollout(engine, tok, GatewayOptions(agent=agent), params, 4, 2048, counts).run(
        [Prompt(messages=[{"role": "user", "content": "2*3?"}])])
    assert ge.ep.status is Status.COMPLETED and ge.rewrites == 0 and ge.ep.turns == 3, ge.failure
    assert seen[:2] == [({"type": "function", "name": "calc"}, "completed", [("calc", {"expr": "2*3"})]),
                        ("required", "completed", [("est", {"expr": "2*3"})])]
    assert seen[2][2] == [] and seen[3].endswith("It is 6.")
    assert counts["gateway_forced_calls"] == 2 and counts["gateway_forced_unparsed"] == 0
    conversation = [{"role": "user", "content": "2*3?"}, _call_turn(name, "calc"), _tool_turn(name, "6"),
                    _call_turn(name, "est"), _tool_turn(name, "~ 6")]
    for ctx, upto, opening in zip(engine.contexts, (1, 3, 5), (*OPENING[name], "")):
        expected = encode_chat(tok, conversation[:upto], add_generation_prompt=True, tools=TOOLS) + ids(opening)
        assert ctx == expected, f"context:  {tok.decode(ctx)!r}\nexpected: {tok.decode(expected)!r}"
    ep = ge.ep
    for ctx, opening in zip(engine.contexts[:2], OPENING[name]):  # forced: masked, no log-prob of their own
        at = len(ctx) - len(ep.prompt_ids)
        n = len(ids(opening))
        assert ep.context[:len(ctx)] == ctx and ep.loss_mask[at - n:at] == [0] * n
        assert ep.logprobs[at - n:at] == [0.0] * n and ep.versions[at - n:at] == [-1] * n


def test_responses_allowed_tools_restrict_the_calls_and_required_forces_one():
    """`{"type": "allowed_tools", "mode": "required", "tools": [calc]}` is a forced call of calc (the one tool
    allowed: its opening and name); with mode `auto` a call of a tool outside the allowed ones is answered
    as text, as an unparseable call is, and counted; the answer repeats the request's tool_choice."""
    tok = _hermes_tokenizer()
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    est = '<tool_call>{"name": "est", "arguments": {"expr": "2*3"}}</tool_call>'
    engine = ScriptedEngine([(ids(REST["hermes"][0]) + [tok.eos_token_id], "stop"),
                             (ids(est) + [tok.eos_token_id], "stop")])
    only_calc = [{"type": "function", "name": "calc"}]
    seen = []

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            items = list(task.messages)
            for mode in ("required", "auto"):
                choice = {"type": "allowed_tools", "mode": mode, "tools": only_calc}
                r, body = _responses_ask(c, False, model="m", input=items, tools=_responses_tools(TOOLS),
                                         tool_choice=choice)
                seen.append((body["tool_choice"] == choice, [(o.type, getattr(o, "name", None)) for o in r.output],
                             r.output_text))
                items += [o.model_dump(exclude_none=True) for o in r.output]
                items += [{"type": "function_call_output", "call_id": o.call_id, "output": "6"}
                          for o in r.output if o.type == "function_call"]

    counts = Counter()
    params = lambda n: SamplingParams(max_new_tokens=64, stop_token_ids=stop_token_ids(tok))  # noqa: E731
    (ge,) = GatewayRollout(engine, tok, GatewayOptions(agent=agent), params, 4, 2048, counts).run(
        [Prompt(messages=[{"role": "user", "content": "2*3?"}])])
    assert ge.ep.status is Status.COMPLETED and ge.rewrites == 0, ge.failure
    assert seen == [(True, [("function_call", "calc")], ""), (True, [("message", None)], est)]
    assert engine.contexts[0][-len(ids(OPENING["hermes"][0])):] == ids(OPENING["hermes"][0])
    assert counts["gateway_disallowed_calls"] == 1 and counts["gateway_forced_calls"] == 1


def _forced_agent(turns):
    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as client:
            messages = list(task.messages)
            for t in range(turns):
                choice = {"type": "function", "function": {"name": "calc"}} if t % 2 == 0 else "required"
                m = client.chat.completions.create(model="m", messages=messages, tools=TOOLS[:1] if t % 2 else TOOLS,
                                                   tool_choice=choice).choices[0].message
                messages.append(m.model_dump(exclude_none=True))
                if m.tool_calls:
                    messages += [{"role": "tool", "tool_call_id": c.id, "content": "= 1"} for c in m.tool_calls]
                else:
                    messages.append({"role": "user", "content": f"more {t}"})
    return agent


def _forced_responses_agent(turns):
    """`_forced_agent` through the Responses API: its flat named function, `required` with one tool."""
    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as client:
            items = list(task.messages)
            for t in range(turns):
                choice = {"type": "function", "name": "calc"} if t % 2 == 0 else "required"
                r = client.responses.create(model="m", input=items, tool_choice=choice,
                                            tools=_responses_tools(TOOLS[:1] if t % 2 else TOOLS))
                items += [o.model_dump(exclude_none=True) for o in r.output]
                calls = [o for o in r.output if o.type == "function_call"]
                items += [{"type": "function_call_output", "call_id": o.call_id, "output": "= 1"} for o in calls]
                if not calls:
                    items.append({"role": "user", "content": f"more {t}"})
    return agent


@pytest.mark.parametrize("wire", ["chat", "responses"])
def test_the_trainer_scores_the_sampled_tokens_of_forced_turns_at_the_engines_log_probs(tiny_model, tokenizer,
                                                                                         wire):
    """The real tiny engine, sampled, through RolloutDataModule: every turn forced (a named function, and
    `required` with one tool), through Chat Completions and through the Responses API. Every action trained on
    is exactly the engine's ids, continued from a context that ends with the forced opening (loss mask 0); at
    identical weights the trainer's log-probs of the recorded tokens equal the engine's within float32
    rounding: the forced tokens are context to both."""
    engine = LocalEngine(tiny_model)
    calls = []
    generate = engine.generate

    def recording(prompts, params):
        gens = generate(prompts, params)
        calls.extend((list(p), g) for p, g in zip(prompts, gens))
        return gens

    engine.generate = recording
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, max_new_tokens=8, max_context=512,
                        temperature=1.0)
    agent = (_forced_agent if wire == "chat" else _forced_responses_agent)(3)
    dm = RolloutDataModule(engine, tokenizer, ArithmeticTask(seed=0), lambda s: float(len(s.response_ids) % 3), cfg,
                           agent=AgentOptions(gateway=GatewayOptions(agent=agent), max_turns=8))
    exp = dm.next_experience()
    assert not any(k.startswith("dropped/") and v for k, v in dm.totals.items()), dict(dm.totals)
    forced = tokenizer("calc:", add_special_tokens=False)["input_ids"]
    by_ctx = {}
    for ctx, g in calls:
        by_ctx.setdefault(tuple(ctx), []).append(g)
    actions = 0
    for s in exp.samples:
        mask = s.loss_mask
        runs = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
        for a in runs:
            b = next((j for j in range(a, len(mask)) if not mask[j]), len(mask))
            ctx = tuple(s.prompt_ids + s.response_ids[:a])
            assert list(ctx[-len(forced):]) == forced and mask[a - len(forced):a] == [0] * len(forced)
            assert any(s.response_ids[a:b] == g.token_ids and s.rollout_logprobs[a:b] == g.logprobs
                       for g in by_ctx[ctx]), "an action is not the engine's answer to the context before it"
            actions += 1
    # a forced turn whose text the line format renders otherwise (`calc:x` sampled, `calc: x` rendered) goes on in a
    # new segment: every episode's segments together hold its three actions
    assert actions == 3 * len({s.rollout_id for s in exp.samples})
    module = GRPO(GRPOConfig(), tiny_model, temperature=1.0, top_k=0)
    lp = module.scoring.compute_logprobs(tiny_model.eval(), exp)
    m = exp.loss_mask.bool()
    gap = float((lp - exp.rollout_logprobs)[m].abs().max())
    tol = model_logprob_tolerance(tiny_model, [s.prompt_ids + s.response_ids for s in exp.samples], temperature=1.0)
    assert gap <= tol, (gap, tol)
