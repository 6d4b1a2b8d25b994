"""GLM's tool-call format (`glmlight.gateway.tool_format.GlmFormat`) against the parsers GLM is served with.

The cases are read off SGLang 0.5.23 (`sglang/srt/function_call/glm4_moe_detector.py` for GLM-4.5/4.6,
`glm47_moe_detector.py` for GLM-4.7/GLM-5, with `sglang/srt/function_call/utils.py`
`infer_type_from_json_schema`) and vLLM 0.32.0 (`vllm/tool_parsers/glm47_moe_tool_parser.py`, which serves both
`glm45` and `glm47`, through `vllm/parser/glm47_moe.py` and `vllm/parser/engine/parser_engine.py`
`_fix_arg_types` with `vllm/tool_parsers/utils.py` `coerce_to_schema_type`); the servers' code is not imported.
Each case names the servers that agree with glmlight; where they disagree among themselves or with glmlight,
the comment says which does what (docs/agents.md, "GLM's typed arguments")."""

import json

import pytest

from glmlight.gateway.messages import Message, ToolCall, ToolSpec
from glmlight.gateway.tool_format import GlmFormat
from tests.support.glm_templates import GLM_TOKENIZERS


def _spec(schema):
    return ToolSpec("f", "", {"type": "object", "properties": {"v": schema}})


def _value(raw, schema):
    text = f"<tool_call>f\n<arg_key>v</arg_key>\n<arg_value>{raw}</arg_value>\n</tool_call>"
    spec = _spec(schema) if schema is not None else ToolSpec("f", "", {"type": "object", "properties": {}})
    content, calls = GlmFormat().parse(text, [spec], lambda: "id")
    assert content == "" and len(calls) == 1
    return calls[0].arguments["v"]


S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
CASES = [
    # (raw value, the parameter's schema, the value): all three parsers agree unless the comment says otherwise
    ("2*3", S, "2*3"),
    ("123", S, "123"),  # SGLang glm4: str(json.loads) = "123" as well
    ("true", S, "true"),  # SGLang glm4: str(True) = "True"
    ('"quoted"', S, '"quoted"'),  # SGLang (both) JSON-decode it to 'quoted'; vLLM keeps it, as the template renders it
    ("[1, 2]", S, "[1, 2]"),  # SGLang glm4 re-dumps it
    (" x ", S, " x "),  # a value is never stripped
    ("5", I, 5), (" 5 ", I, 5), ("2.5", N, 2.5), ("3", N, 3), ("-4", I, -4),
    ("abc", I, "abc"),  # not a number: kept as written
    ("true", B, True), ("false", B, False),
    ("True", B, True),  # vLLM lower-cases, SGLang reads it as a Python literal
    ('{"a": [1, null]}', {"type": "object"}, {"a": [1, None]}), ('[1, "x"]', {"type": "array"}, [1, "x"]),
    ("{not json", {"type": "object"}, "{not json"),
    ("null", {"type": ["string", "null"]}, None),  # SGLang glm4: "None"
    ("123", {"type": ["string", "null"]}, "123"),  # a string may be one: SGLang glm47 and vLLM keep it
    ("7", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 7),
    ("1", {"enum": ["1", "2"]}, "1"),  # enum of strings: a string (SGLang glm4: 1)
    ("2", {"enum": [1, 2]}, 2),
    ("null", {"type": "null"}, None),
    ("5", None, 5),  # a parameter the schema does not declare: JSON-decoded as SGLang does (vLLM keeps "5")
    ("x y", None, "x y"),
]


@pytest.mark.parametrize("raw, schema, value", CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)])
def test_a_value_is_typed_as_the_servers_read_it(raw, schema, value):
    got = _value(raw, schema)
    assert got == value and type(got) is type(value), (raw, schema, got)


@pytest.mark.parametrize("text, name, args", [
    # GLM-4.5: newlines after the name and around the tags; GLM-4.7/GLM-5: none
    ("<tool_call>f\n<arg_key>v</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", "f", {"v": 1}),
    ("<tool_call>f<arg_key>v</arg_key><arg_value>1</arg_value></tool_call>", "f", {"v": 1}),
    ("<tool_call>f<arg_key> v </arg_key>\n\n<arg_value>1</arg_value></tool_call>", "f", {"v": 1}),  # key stripped
    ("<tool_call>g</tool_call>", "g", {}),  # no arguments (vLLM's glm47 parser; GLM-4.7's template renders it so)
    ("<tool_call>g\n</tool_call>", "g", {}),
])
def test_both_layouts_parse(text, name, args):
    tools = [_spec(I), ToolSpec("g", "", {"type": "object", "properties": {}})]
    content, calls = GlmFormat().parse("intro " + text + " outro", tools, lambda: "id")
    assert [(c.name, c.arguments) for c in calls] == [(name, args)] and content == "intro  outro"


def test_a_call_of_an_undeclared_tool_stays_text():
    text = "<tool_call>nope<arg_key>v</arg_key><arg_value>1</arg_value></tool_call>"
    assert GlmFormat().parse(text, [_spec(I)], lambda: "id") == (text, [])


TOOL = ToolSpec("probe", "", {"type": "object", "properties": {
    "s": S, "n": I, "x": N, "b": B, "o": {"type": "object"}, "a": {"type": "array"}, "z": {"type": ["string", "null"]},
    "q": S}})
ARGS = {"s": "2*3", "n": 3, "x": 2.5, "b": False, "o": {"k": [1, None]}, "a": [1, "x"], "z": None, "q": "42"}


@pytest.mark.parametrize("name", ["glm45", "glm45_training", "glm47"])
def test_calls_round_trip_through_the_template(name):
    """Structured calls (two in one turn, every JSON type) -> the template's text -> parse -> the same calls, as the
    OpenAI wire (`arguments`, JSON) and the Anthropic wire (`input`) carry them; and that text -> parse -> the
    template's rendering of the parsed message -> the same text."""
    tok, fmt = GLM_TOKENIZERS[name](), GlmFormat()
    calls = [ToolCall("c0", "probe", ARGS), ToolCall("c1", "probe", {"s": "second", "n": -1})]
    user = fmt.template_message(Message("user", "go"), [TOOL])
    render = lambda m: tok.apply_chat_template([user, fmt.template_message(m, [TOOL])],  # noqa: E731
                                               tools=[TOOL.openai()], tokenize=False)
    opened = tok.apply_chat_template([user], tools=[TOOL.openai()], add_generation_prompt=True, tokenize=False)
    at = opened.rindex("<|assistant|>") + len("<|assistant|>")
    text = render(Message("assistant", "", calls))[at:]
    # the model ends the turn with the marker the training variant renders as part of it: its stop token
    content, parsed = fmt.parse(text.removesuffix("<|observation|>"), [TOOL], lambda: "id")
    assert [(c.name, c.arguments) for c in parsed] == [(c.name, c.arguments) for c in calls]
    assert [json.loads(json.dumps(c.arguments)) for c in parsed] == [ARGS, {"s": "second", "n": -1}]
    assert all(type(parsed[0].arguments[k]) is type(v) for k, v in ARGS.items())
    assert render(Message("assistant", content, parsed))[at:] == text
