"""The gateway's own form of a chat turn, shared by the wire formats.

Each wire module (`openai_wire`, `responses_wire`, `anthropic_wire`) turns a request into a `TurnRequest` (the
conversation as `Message`s, the declared `ToolSpec`s, the sampling options) and a `TurnResult`
back into its own response. A request the gateway cannot serve raises `WireError`: an HTTP status,
a kind (what the error means for the episode) and a message the agent gets in its wire's error body.

What the wires check alike lives here too: the tool a forced `tool_choice` names and the tools a turn may
call (`forced_choice`), the final assistant message a turn continues (`split_prefill`), a tool declared
`strict` (`tool_spec`, `ToolSpec.accepts`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# WireError kinds: what the error means for the episode.
BAD_REQUEST = "bad_request"  # malformed or unsupported: the episode fails
CONTEXT = "context_length"  # the context or turn budget is spent: the episode ends truncated
AUTH = "authentication"  # no episode has this key
CLOSED = "closed"  # the episode has ended (failed, truncated or closed): nothing changes
SERVER = "server"  # the engine failed: the episode fails
NOT_FOUND = "not_found"  # no such route or model: nothing changes
TOO_LARGE = "too_large"  # the request body is over the server's limit: nothing changes


class WireError(Exception):
    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


def bad_request(message: str) -> WireError:
    return WireError(400, BAD_REQUEST, message)


def call_arguments(raw: Any, where: str) -> dict[str, Any]:
    """A tool call's arguments as an OpenAI client sends them back: a JSON string (or an object) of an object;
    missing or empty means none. `where` names the field in the error."""
    try:
        args = json.loads(raw) if isinstance(raw, str) and raw else (raw or {})
    except ValueError:
        raise bad_request(f"{where} is not valid JSON") from None
    if not isinstance(args, dict):
        raise bad_request(f"{where} must be a JSON object")
    return args


def number(body: dict, key: str, low: float, high: float) -> float | None:
    """`body[key]` as a float in [low, high], None when absent; anything else is a 400 that names it."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high:
        raise bad_request(f"{key} must be a number in [{low}, {high}], got {v!r}")
    return float(v)


def request_messages(body: Any) -> list[Any]:
    """The `messages` list of a request body (both wires): a JSON object with a non-empty list."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages must be a non-empty list")
    return msgs


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)  # JSON schema of the arguments
    strict: bool = False  # the agent is promised arguments that conform to `parameters` (`accepts`)

    def key(self) -> str:
        """What makes two declarations the same for the chat template (`strict` is not rendered)."""
        return json.dumps([self.name, self.description, self.parameters], sort_keys=True)

    def accepts(self, arguments: dict[str, Any]) -> bool:
        """Whether a call of this tool with `arguments` may be returned: any call, unless the tool is `strict`;
        then only one whose arguments conform to its schema (what OpenAI's strict function calling promises;
        the gateway samples the policy unconstrained, so it keeps the promise by returning no other call)."""
        return not self.strict or _validator(self.parameters).is_valid(arguments)

    def openai(self) -> dict[str, Any]:
        """The OpenAI function-tool form (the form Hugging Face chat templates take in `tools=`)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class Message:
    role: str  # system | user | assistant | tool
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None  # a tool result: the call it answers

    def key(self) -> tuple:
        """What makes two messages the same turn. An assistant message is compared by its text (outer
        whitespace aside) and its calls' names and arguments: clients re-serialise arguments and may
        drop or strip the text, and a call's id is only the wire's pairing of call and result."""
        if self.role == "assistant":
            calls = tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in self.tool_calls)
            return ("assistant", self.content.strip(), calls)
        return (self.role, self.content, self.tool_call_id or "")


@dataclass
class TurnRequest:
    messages: list[Message]  # without `prefill`
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: str = "auto"  # auto | none | required (the turn starts a tool call)
    tool_name: str | None = None  # with required: the tool the call is of (None: any of `tools`)
    tool_named: bool = False  # the request's tool_choice named that tool (not `required` of a single tool)
    allowed: list[str] | None = None  # the tools the turn's calls may be of (None: any of `tools`)
    prefill: Message | None = None  # the request's final assistant message, which the turn continues
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    model: str = ""
    include_usage: bool = False  # OpenAI stream_options.include_usage


@dataclass
class TurnResult:
    content: str
    tool_calls: list[ToolCall]
    finish: str  # stop | length | tool_calls | stop_sequence
    stop_sequence: str | None
    prompt_tokens: int
    completion_tokens: int
    turn: int  # 1 for the episode's first turn
    episode: str  # the episode's public id (not its key)


def _validator(schema: dict[str, Any]) -> Any:
    try:
        import jsonschema
    except ImportError:
        raise bad_request("strict tools need the jsonschema package where the gateway runs "
                          "(pip install -e '.[gateway]')") from None
    return jsonschema.validators.validator_for(schema)(schema)


def tool_spec(name: str, description: Any, parameters: Any, strict: Any, where: str) -> ToolSpec:
    """A declared tool; with `strict` true its schema must be a valid JSON schema (`ToolSpec.accepts`)."""
    if strict not in (None, True, False):
        raise bad_request(f"{where}.strict must be true or false, got {strict!r}")
    params = parameters or {}
    if not isinstance(params, dict):
        raise bad_request(f"{where}: the parameters (input schema) must be a JSON schema object")
    spec = ToolSpec(name, str(description or ""), params, bool(strict))
    if spec.strict:
        import jsonschema

        try:
            type(_validator(params)).check_schema(params)
        except jsonschema.SchemaError as e:
            raise bad_request(f"{where}: strict: true needs a valid JSON schema ({e.message})") from None
    return spec


def split_prefill(messages: list[Message]) -> tuple[list[Message], Message | None]:
    """The request's messages, and the final assistant message the turn continues (Anthropic's prefill; the
    same on the OpenAI wire) when there is one. An empty final assistant message is no prefill: the turn
    starts as any turn does. One with tool calls cannot be continued."""
    last = messages[-1]
    if last.role != "assistant":
        return messages, None
    if last.tool_calls:
        raise bad_request("the request ends with an assistant message with tool calls: send their results (tool "
                          "messages) before asking for the next turn")
    if not last.content and len(messages) == 1:
        raise bad_request("messages hold only an empty assistant message: there is nothing to answer")
    return messages[:-1], (last if last.content else None)


def forced_choice(kind: str, name: str | None, tools: list[ToolSpec], prefill: Message | None, label: str,
                  noun: str, allowed: list[str] | None = None) -> tuple[str, str | None]:
    """(tool_choice, tool_name) of a request whose tool choice is `kind` (auto | none | required), `name`
    (the tool a required call must be of, or None) and `allowed` (the tools the turn may call, the Responses
    API's allowed_tools; None: all of `tools`); `label` and `noun` are how the wire names them in an error.
    `required` with a single tool, or a single allowed one, names it."""
    if kind != "required" and allowed is None:
        return kind, None
    if not tools:
        raise bad_request(f"{label} needs tools: the request declares none to call")
    declared = [t.name for t in tools]
    for n in ([name] if name is not None else []) + (allowed or []):
        if n not in declared:
            raise bad_request(f"tool_choice names the {noun} {n!r}, which is not among the request's tools "
                              f"({', '.join(declared)})")
    if kind != "required":
        return kind, None
    if prefill is not None:
        raise bad_request("an assistant message to continue (prefill) cannot be combined with a forced tool_choice: "
                          "the turn would have to start with both the message's text and a tool call")
    choices = declared if allowed is None else allowed
    return kind, name if name is not None or len(choices) > 1 else choices[0]
