"""How tool calls look in the model's text, per chat template.

The sampled tokens are the action; a format only reads the structured calls off their text (for the
wire's `tool_calls` / `tool_use`) and says how a conversation's assistant and tool turns are handed
to the chat template when the gateway has to render them (a prompt, or a rewritten history).

- `line` (glmlight's own template, which knows no tools): a call is a line `<name>: <argument>`
  whose name is one of the request's tools. The argument is the tool's one parameter (its value as
  written; an integer or number when the schema says so) or, for any tool, a JSON object of all its
  arguments. Every other line is the message's text. A tool result is the template's observation
  turn (`<|observation|>`). The calculator's `calc: 37*58` is a call of a tool `calc` with one
  parameter: `{"expr": "37*58"}`.
- `hermes` (templates that render `<tool_call>` blocks: Qwen2.5, Qwen3 and others): a call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
- `glm` (GLM-4.5 and later): `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>`,
  with or without newlines between the name and the tags (GLM-4.5 writes them, GLM-4.7 does not), a key
  stripped, a value never: as written when its parameter admits only a string (the template writes a string
  as it is), else typed by the schema as SGLang's and vLLM's GLM parsers do (`GlmFormat.value`).

For `hermes` and `glm` the template renders the structured calls, tool results and tool declarations
itself (`tool_calls`, role `tool`, `tools=`). Text outside the calls (reasoning included) is the
message's content. `auto` picks by the template's text: `glm` when it has `<arg_key>`, `hermes`
when it has `<tool_call>`, else `line`.

A forced tool call (`tool_choice` required or a named function) starts with the text the template renders
a call with up to the tool's name (`glmlight.gateway.template.TurnCodec.forced_call`); for a named tool,
then the name and `after_name`, what the format puts between the name and the arguments (`line`: the
colon; `hermes`: `", "arguments":`; `glm`: nothing, the arguments' tags follow). Each ends where a
tokenizer's pre-tokenizer splits anyway, so the sampled rest starts on a token boundary the model knows.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from glmlight.errors import ConfigError
from glmlight.gateway.messages import Message, ToolCall, ToolSpec

NewId = Callable[[], str]


class ToolFormat:
    name = ""
    tool_role = "tool"  # the template's role of a tool result
    after_name = ""  # what a call's text has between the tool's name and its arguments (a forced named call)

    def parse(self, text: str, tools: list[ToolSpec], new_id: NewId) -> tuple[str, list[ToolCall]]:
        """(the message's text, the tool calls) of one sampled turn."""
        raise NotImplementedError

    def template_message(self, m: Message, tools: list[ToolSpec]) -> dict[str, Any]:
        """`m` as the chat template takes it."""
        if m.role == "tool":
            out: dict[str, Any] = {"role": self.tool_role, "content": m.content}
            if m.tool_call_id and self.tool_role == "tool":
                out["tool_call_id"] = m.tool_call_id
            return out
        if m.role == "assistant" and m.tool_calls:
            return {"role": "assistant", "content": m.content,
                    "tool_calls": [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments}} for c in m.tool_calls]}
        return {"role": m.role, "content": m.content}


def _declared(tools: list[ToolSpec]) -> dict[str, ToolSpec]:
    return {t.name: t for t in tools}


def _properties(spec: ToolSpec) -> dict[str, Any]:
    props = spec.parameters.get("properties") if isinstance(spec.parameters, dict) else None
    return props if isinstance(props, dict) else {}


def _typed(raw: str, schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, dict) else None
    try:
        if kind == "integer" and re.fullmatch(r"-?\d+", raw):
            return int(raw)
        if kind == "number":
            return float(raw) if not re.fullmatch(r"-?\d+", raw) else int(raw)
        if kind == "boolean" and raw in ("true", "false"):
            return raw == "true"
    except ValueError:
        pass
    return raw


class LineFormat(ToolFormat):
    name = "line"
    tool_role = "observation"
    after_name = ":"
    _LINE = re.compile(r"^\s*([A-Za-z0-9_-]+):[ \t]?(.*)$")

    def parse(self, text: str, tools: list[ToolSpec], new_id: NewId) -> tuple[str, list[ToolCall]]:
        declared = _declared(tools)
        calls, kept = [], []
        for line in text.split("\n"):
            m = self._LINE.match(line)
            args = self.arguments(m.group(2).strip(), declared[m.group(1)]) if m and m.group(1) in declared else None
            if args is None:
                kept.append(line)
            else:
                calls.append(ToolCall(new_id(), m.group(1), args))
        return (text if not calls else "\n".join(kept).strip()), calls

    @staticmethod
    def arguments(raw: str, spec: ToolSpec) -> dict[str, Any] | None:
        """A JSON object, or the value of the tool's one parameter; None when it is neither."""
        if raw.startswith("{"):
            try:
                value = json.loads(raw)
            except ValueError:
                value = None
            if isinstance(value, dict):
                return value
        props = _properties(spec)
        if len(props) == 1:
            (name, schema), = props.items()
            return {name: _typed(raw, schema)}
        return {} if not props and not raw else None

    def render(self, content: str, calls: list[ToolCall], tools: list[ToolSpec]) -> str:
        declared = _declared(tools)
        lines = [content] if content else []
        for c in calls:
            props = _properties(declared[c.name]) if c.name in declared else {}
            single = len(props) == 1 and list(c.arguments) == list(props)
            value = next(iter(c.arguments.values())) if single else None
            if single and isinstance(value, (str, int, float)) and not isinstance(value, bool) \
                    and "\n" not in str(value) and not str(value).startswith("{"):
                lines.append(f"{c.name}: {value}")
            else:
                lines.append(f"{c.name}: {json.dumps(c.arguments)}")
        return "\n".join(lines)

    def template_message(self, m: Message, tools: list[ToolSpec]) -> dict[str, Any]:
        if m.role == "assistant":
            return {"role": "assistant", "content": self.render(m.content, m.tool_calls, tools)}
        return super().template_message(m, tools)


class HermesFormat(ToolFormat):
    name = "hermes"
    after_name = '", "arguments":'
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str, tools: list[ToolSpec], new_id: NewId) -> tuple[str, list[ToolCall]]:
        declared, calls = _declared(tools), []

        def take(m: re.Match) -> str:
            try:
                obj = json.loads(m.group(1))
                args = obj.get("arguments", {}) if isinstance(obj, dict) else None
                args = json.loads(args) if isinstance(args, str) else args
            except ValueError:
                return m.group(0)
            if not isinstance(args, dict) or obj.get("name") not in declared:
                return m.group(0)
            calls.append(ToolCall(new_id(), obj["name"], args))
            return ""

        rest = self._CALL.sub(take, text)
        return (text if not calls else rest.strip()), calls


class GlmFormat(ToolFormat):
    name = "glm"
    _CALL = re.compile(r"<tool_call>\s*([^<\s]+)\s*(.*?)</tool_call>", re.DOTALL)
    _ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def parse(self, text: str, tools: list[ToolSpec], new_id: NewId) -> tuple[str, list[ToolCall]]:
        declared, calls = _declared(tools), []

        def take(m: re.Match) -> str:
            name = m.group(1)
            if name not in declared:
                return m.group(0)
            props = _properties(declared[name])
            args = {k.strip(): self.value(v, props.get(k.strip())) for k, v in self._ARG.findall(m.group(2))}
            calls.append(ToolCall(new_id(), name, args))
            return ""

        rest = self._CALL.sub(take, text)
        return (text if not calls else rest.strip()), calls


    @staticmethod
    def value(raw: str, schema: Any) -> Any:
        """An argument's value as written between `<arg_value>` tags, typed by its parameter's schema: as written
        when the schema admits only a string; else JSON-decoded when the decoded type is one it admits (an integer
        where it admits a number; `True`/`False` where it admits a boolean), else as written when it admits a
        string, else JSON-decoded when it decodes at all. A parameter whose schema names no type is JSON-decoded
        when it decodes."""
        admitted = _admitted_types(schema)
        if admitted == {"string"}:
            return raw
        try:
            decoded = json.loads(raw)
        except ValueError:
            if admitted and "boolean" in admitted and raw.strip() in ("True", "False"):
                return raw.strip() == "True"
            return raw
        if admitted is None or _json_type(decoded) in admitted:
            return decoded
        return raw if "string" in admitted else decoded


_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
               (dict, "object"))


def _json_type(value: Any) -> str:
    return "null" if value is None else next(t for cls, t in _JSON_TYPES if isinstance(value, cls))


def _admitted_types(schema: Any) -> set[str] | None:
    """The JSON types a parameter's schema admits (`type`, `enum`/`const` values, `anyOf`/`oneOf` branches; an
    integer where it admits a number); None when it names none."""
    if not isinstance(schema, dict):
        return None
    kinds: set[str] = set()
    kind = schema.get("type")
    kinds.update([kind] if isinstance(kind, str) else [k for k in kind if isinstance(k, str)]
                 if isinstance(kind, list) else [])
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list):
        kinds.update(_json_type(v) for v in values if isinstance(v, (type(None), bool, int, float, str, list, dict)))
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or []:
            kinds.update(_admitted_types(branch) or ())
    if "number" in kinds:
        kinds.add("integer")
    return kinds or None


FORMATS = {f.name: f for f in (LineFormat, HermesFormat, GlmFormat)}


def tool_format(name: str, chat_template: str | None) -> ToolFormat:
    """The format `name` (line | hermes | glm), or with "auto" the one `chat_template` uses."""
    if name == "auto":
        text = chat_template or ""
        name = "glm" if "<arg_key>" in text else "hermes" if "<tool_call>" in text else "line"
    if name not in FORMATS:
        raise ConfigError(f"config error: task.agent.gateway.tool_format={name!r} is not one of "
                          f"{['auto', *FORMATS]}")
    return FORMATS[name]()
