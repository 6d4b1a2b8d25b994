"""The agent gateway's tool-call formats and turn splicing per chat template, and its configuration."""

import itertools
import json
from collections import Counter

import openai
import pytest

import glmlight
from glmlight import compose
from glmlight.errors import ConfigError
from glmlight.gateway.messages import Message, ToolCall, ToolSpec
from glmlight.gateway.runner import GatewayOptions, GatewayRollout
from glmlight.gateway.template import TurnCodec
from glmlight.gateway.tool_format import GlmFormat, HermesFormat, LineFormat, tool_format
from glmlight.models.tokenizer import CHAT_TEMPLATE, build_char_tokenizer, encode_chat, stop_token_ids
from glmlight.prompt import Prompt
from glmlight.engines.base import Generation, SamplingParams
from glmlight.sample import Status

CALC = ToolSpec("calc", "exact value", {"type": "object", "properties": {"expr": {"type": "string"}}})
ADD = ToolSpec("add", "a + b", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})
ROUND = ToolSpec("round", "", {"type": "object", "properties": {"n": {"type": "integer"}}})


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def test_line_format_reads_calls_of_declared_tools_only():
    f = LineFormat()
    assert f.parse("calc: 37*58", [CALC], _ids()) == ("", [ToolCall("call_0", "calc", {"expr": "37*58"})])
    assert f.parse("answer: 2146", [CALC], _ids()) == ("answer: 2146", [])  # not a tool: the text
    assert f.parse("calc: 1+1", [], _ids()) == ("calc: 1+1", [])
    text, calls = f.parse('thinking\nadd: {"a": 1, "b": 2}\nround: 7', [CALC, ADD, ROUND], _ids())
    assert text == "thinking" and [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2}),
                                                                             ("round", {"n": 7})]
    assert f.parse("add: 1 2", [ADD], _ids()) == ("add: 1 2", [])  # two parameters need a JSON object
    for calls in ([ToolCall("x", "calc", {"expr": "37*58"})], [ToolCall("x", "add", {"a": 1, "b": 2})],
                  [ToolCall("x", "round", {"n": 7}), ToolCall("y", "calc", {"expr": "{"})]):
        text = f.render("", calls, [CALC, ADD, ROUND])
        assert [(c.name, c.arguments) for c in f.parse(text, [CALC, ADD, ROUND], _ids())[1]] == \
            [(c.name, c.arguments) for c in calls]
    assert f.render("", [ToolCall("x", "calc", {"expr": "37*58"})], [CALC]) == "calc: 37*58"


def test_hermes_and_glm_formats():
    h = HermesFormat()
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert h.parse(text, [ADD], _ids()) == ("Let me add.", [ToolCall("call_0", "add", {"a": 1, "b": 2})])
    assert h.parse(text, [CALC], _ids()) == (text, [])  # an undeclared tool stays text
    assert h.parse("<tool_call>{not json</tool_call>", [ADD], _ids())[1] == []
    g = GlmFormat()
    text = "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_key>b</arg_key>\n" \
           "<arg_value>2</arg_value>\n</tool_call>"
    assert g.parse(text, [ADD], _ids()) == ("", [ToolCall("call_0", "add", {"a": 1, "b": 2})])
    assert g.parse("<tool_call>calc\n<arg_key>expr</arg_key><arg_value>12</arg_value></tool_call>", [CALC],
                   _ids())[1][0].arguments == {"expr": "12"}  # a string parameter stays a string
    assert tool_format("auto", CHAT_TEMPLATE).name == "line"
    assert tool_format("auto", "...<tool_call>...").name == "hermes"
    assert tool_format("auto", "...<arg_key>...<tool_call>").name == "glm"
    with pytest.raises(ConfigError, match="tool_format"):
        tool_format("xml", None)


# A template of the hermes kind, for the character tokenizer: tools declared in a system turn, calls as
# <tool_call> blocks, tool results wrapped, and a newline after each turn's end token.
HERMES_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|assistant|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<eos>\n"
    "{% elif m.role == 'tool' %}<|observation|><tool_response>{{ m.content }}</tool_response>\n"
    "{% else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class ScriptedEngine:
    """Answers the i-th request with the i-th text (its ids, then <eos>)."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.version = tokenizer, list(texts), 0

    def generate(self, prompts, params):
        ids = self.tokenizer(self.texts.pop(0), add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return [Generation(ids, [-0.5] * len(ids), "stop", [0] * len(ids))]


def test_hermes_template_spliced_turns_equal_the_whole_conversation_rendered():
    """With a template that renders calls, results and tool declarations itself: the gateway's record of a
    two-turn tool episode (the sampled ids, the template's newline after the end token, the tool result,
    the next opening) is the template's rendering of the whole conversation; the agent saw a structured
    call."""
    tok = build_char_tokenizer()
    tok.chat_template = HERMES_TEMPLATE
    call = '<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call>'
    engine = ScriptedEngine(tok, [call, "It is 6."])
    codec = TurnCodec(tok, tool_format("auto", tok.chat_template), stop_token_ids(tok))
    assert codec.fmt.name == "hermes" and codec.renders_tools and tok.decode(codec.closing) == "<eos>\n"
    tools = [{"type": "function", "function": {"name": "calc", "description": "exact value",
                                               "parameters": CALC.parameters}}]
    seen = {}

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            msgs = list(task.messages)
            m = c.chat.completions.create(model="m", messages=msgs, tools=tools).choices[0].message
            seen["call"] = (m.tool_calls[0].function.name, json.loads(m.tool_calls[0].function.arguments), m.content)
            msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id,
                                                       "content": "6"}]
            seen["final"] = c.chat.completions.create(model="m", messages=msgs, tools=tools).choices[0].message.content
            seen["messages"] = msgs

    params = lambda n: SamplingParams(max_new_tokens=64, stop_token_ids=[1])  # noqa: E731
    (ge,) = GatewayRollout(engine, tok, GatewayOptions(agent=agent), params, 4, 512, Counter()).run(
        [Prompt(messages=[{"role": "user", "content": "2*3?"}])])
    assert seen["call"] == ("calc", {"expr": "2*3"}, None) and seen["final"] == "It is 6."
    ep = ge.ep
    assert ep.status is Status.COMPLETED and ge.rewrites == 0
    whole = [{"role": "user", "content": "2*3?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "calc", "arguments": {"expr": "2*3"}}}]},
             {"role": "tool", "content": "6"}, {"role": "assistant", "content": "It is 6."}]
    assert ep.context + tok("\n", add_special_tokens=False)["input_ids"] == encode_chat(tok, whole, False, tools)
    assert [c.name for c in ge.calls] == ["calc"]


def test_a_template_that_renders_the_last_assistant_turn_otherwise_is_spliced():
    """A template that marks only the last assistant turn (as templates that drop earlier turns' reasoning
    do): the new messages' ids are still exactly what the template renders after an assistant turn."""
    tok = build_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|>{% if loop.last %}[r]{% endif %}"
        "{{ m.content }}<eos>\n{% else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    codec = TurnCodec(tok, LineFormat(), stop_token_ids(tok))
    assert tok.decode(codec.closing) == "<eos>\n"
    got = codec.extension([Message("user", "go on")], [])
    assert tok.decode(got) == "<|user|>go on\n<|assistant|>"
    assert tok.decode(codec.splice(tok("ok", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                                   [Message("user", "go on")], [])) == "\n<|user|>go on\n<|assistant|>"


def test_turn_codec_refuses_what_it_cannot_encode():
    tok = build_char_tokenizer()
    codec = TurnCodec(tok, LineFormat(), stop_token_ids(tok))
    assert codec.closing == [tok.eos_token_id] and not codec.renders_tools
    with pytest.raises(Exception, match="cannot encode"):
        codec.extension([Message("user", "caf\u00e9")], [])


@pytest.mark.parametrize("override, message", [
    (["task.agent.gateway.command=[python,x.py]"], "set agent .* or command, not both"),
    (["task.agent.gateway.agent=examples/nope.py:run"], "no file examples/nope.py"),
    (["task.agent.gateway.agent=examples/calculator_openai_agent.py:nope"], "has no attribute 'nope'"),
    (["task.agent.gateway.agent=oops"], "expected 'pkg.module:function'"),
    ([], "task.agent.env must be null"),
    (["task.agent.gateway.reward=judge"], "task.agent.gateway.reward='judge' is not one of"),
    (["task.agent.gateway.timeout_s=0"], "task.agent.gateway.timeout_s must be"),
])
def test_gateway_config_errors_are_one_line(tmp_path, override, message):
    cfg = compose(["task=gateway_agent", "model.preset=test", "model.warm_start.steps=0", "logger=none",
                   f"trainer.default_root_dir={tmp_path}", *override])
    if not override:  # an environment beside the agent program
        cfg.task.agent.env = {"_target_": "glmlight.agents.envs.CalculatorEnv"}
    with pytest.raises(ConfigError, match=message):
        glmlight.build(cfg)


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
@pytest.mark.parametrize("body, message", [
    ([], "the request body must be a JSON object"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 7},
     "temperature must be a number in [0.0, {t}], got 7"),  # OpenAI's range is [0, 2], Anthropic's [0, 1]
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "top_p": True},
     "top_p must be a number in [0.0, 1.0], got True"),
])
def test_both_wires_refuse_a_malformed_request_with_a_400_that_names_it(wire, body, message):
    import importlib

    from glmlight.gateway.messages import WireError

    parse = importlib.import_module(f"glmlight.gateway.{wire}_wire").parse_request
    with pytest.raises(WireError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.message == message.format(t={"openai": 2.0, "anthropic": 1.0}[wire])
