"""Token ids of conversation turns: the chat template, spliced turn by turn.

An episode's ids grow by splicing: the engine's sampled ids as they are, then the ids of the
messages the agent adds (tool results, user turns) and of the opening of the next assistant turn.
Those are rendered after a fixed two-turn conversation (a user turn, an assistant turn), so that
what a template adds at the start of a conversation (a default system prompt, a BOS) is not repeated,
and so that how the template renders the real earlier turns never matters: ids already in the
episode are never rendered again. They are what follows the assistant turn's text in that
rendering: the part two renderings with different assistant texts have in common at their end, less
the template's `closing` (so a template that renders an earlier assistant turn otherwise than the last
one, e.g. with its reasoning dropped, is spliced as well). `closing` is what the template puts after
an assistant turn's text whatever follows (its end-of-turn token and what follows it; nothing in
GLM-4.5's template, where the next turn's role marker ends the turn). The sampled turn is followed by
`closing` and the new messages' ids, less their first token when the model ended its turn with that
very token (`<|im_end|>` in ChatML, `<|observation|>` before a tool result in GLM-4.5's template): it is
in the episode already, sampled. A turn cut short (by max_tokens or a stop string) gets all of it, so
the next turn starts where the template starts one (`glmlight.models.tokenizer.splice_after_action`).
`extend` checks the splice against the template's rendering of the whole conversation (as text): where the
template renders what closes a turn by its content (GLM-4.5's training variant: `<|observation|>` after tool
calls) the rest of that rendering is taken instead, and where it renders the earlier turns otherwise than the
episode holds them, nothing extends the episode (the turn opens a new segment).

Two kinds of ids go into a turn's context that the model does not sample: a final assistant message the
turn continues (a prefill: `encode` with it, or `prefill` after the turns spliced before it), rendered as
the template renders that message left open; and the opening of a tool call a forced `tool_choice` asks
for (`forced_call`): the text the template renders an assistant tool-call turn with before the tool's
name (nothing in glmlight's line format, `<tool_call>{"name": "` in Hermes-style templates,
`\n<think></think>\n<tool_call>` in GLM-4.5's), read off a rendered probe call, and for a named tool the
name and what the format puts after it (`ToolFormat.after_name`).
"""

from __future__ import annotations

import threading
from typing import Any

from glmlight.errors import ConfigError
from glmlight.gateway.messages import Message, ToolCall, ToolSpec, bad_request
from glmlight.gateway.tool_format import ToolFormat
from glmlight.models.tokenizer import (SPLICE_BASE, PromptEncodingError, assistant_closing, encode_chat,
                                       extend_to_rendering, rendered_text, splice_after_action, spliced_turns)

_PROBE_TOOL = ToolSpec("probe", "a probe", {"type": "object", "properties": {"a": {"type": "string"}}})
_PROBE_NAME = "glmlight_probe_tool"  # a tool name that appears nowhere else in a rendered probe call


class TurnCodec:
    def __init__(self, tokenizer: Any, fmt: ToolFormat, stop_ids: list[int]):
        self.tokenizer, self.fmt, self.stop_ids = tokenizer, fmt, set(stop_ids)
        self._lock = threading.Lock()  # a fast tokenizer is not safe to call from many threads at once
        with self._lock:
            self.closing = assistant_closing(tokenizer)
        self.renders_tools = (self._encode(SPLICE_BASE[:1], True, [_PROBE_TOOL])
                              != self._encode(SPLICE_BASE[:1], True, []))
        for probe in ([Message("user", "z")], [Message("tool", "z", tool_call_id="c")]):
            try:
                self.extension(probe, [])
            except Exception as e:  # noqa: BLE001
                raise ConfigError(f"config error: the chat template cannot be spliced turn by turn for the agent "
                                  f"gateway ({getattr(e, 'message', e)})") from None
        self.call_opening = self._call_opening()

    def _encode(self, messages: list[dict[str, Any]], gen: bool, tools: list[ToolSpec],
                open_last: bool = False) -> list[int]:
        with self._lock:
            return encode_chat(self.tokenizer, messages, add_generation_prompt=gen,
                               tools=[t.openai() for t in tools] or None, continue_final_message=open_last)

    def _call_opening(self) -> tuple[str, str] | None:
        """(the text an assistant turn opens a tool call with, up to the tool's name; what follows the name
        before the arguments), as the template renders a probe call; None when it renders no call."""
        tool = ToolSpec(_PROBE_NAME, "", _PROBE_TOOL.parameters)
        base = [self.fmt.template_message(Message("user", "x"), [tool])]
        call = self.fmt.template_message(Message("assistant", "", [ToolCall("c", _PROBE_NAME, {"a": "x"})]), [tool])
        try:
            with self._lock:
                kw = dict(tokenize=False, tools=[tool.openai()])
                opened = self.tokenizer.apply_chat_template(base, add_generation_prompt=True, **kw)
                whole = self.tokenizer.apply_chat_template(base + [call], add_generation_prompt=False, **kw)
        except Exception:  # noqa: BLE001 - a template that cannot render a tool call: nothing can be forced
            return None
        turn = whole[len(opened):] if isinstance(whole, str) and whole.startswith(opened) else ""
        if _PROBE_NAME not in turn:
            return None
        before, after = turn.split(_PROBE_NAME, 1)
        return before, self.fmt.after_name if after.startswith(self.fmt.after_name) else ""

    def forced_call(self, name: str | None) -> tuple[list[int], str]:
        """The ids and text a turn that must call a tool starts with (`name`: of that tool; None: any): the
        template's tool-call opening, and for a named tool its name and what follows the name. A template
        that renders no tool call forces nothing."""
        if self.call_opening is None:
            return [], ""
        before, after = self.call_opening
        text = before + (name + after if name is not None else "")
        if not text:
            return [], ""
        with self._lock:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), text

    def decode(self, ids: list[int]) -> str:
        """The text of sampled ids (special tokens left out)."""
        with self._lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode(self, messages: list[Message], tools: list[ToolSpec], prefill: Message | None = None) -> list[int]:
        """The ids of a whole conversation, up to the opening of the next assistant turn (a new segment), or
        with `prefill`, up to the end of that assistant message's text, left open."""
        rendered = [self.fmt.template_message(m, tools) for m in [*messages, *([prefill] if prefill else [])]]
        try:
            return self._encode(rendered, prefill is None, tools, open_last=prefill is not None)
        except PromptEncodingError as e:
            raise bad_request(f"the model's chat template cannot encode these messages: {e}") from None

    def prefill(self, m: Message, tools: list[ToolSpec]) -> list[int] | None:
        """The ids of the assistant message `m` left open, as the template renders them after the assistant
        turn's opening (what a turn that continues `m` starts from); None when the template renders the
        opening of a turn it continues otherwise than a new turn's (the turn then opens a new segment)."""
        base = [{"role": "user", "content": "x"}]
        try:
            opened = self._encode(base, True, tools)
            whole = self._encode(base + [self.fmt.template_message(m, tools)], False, tools, open_last=True)
        except PromptEncodingError as e:
            raise bad_request(f"the model's chat template cannot encode these messages: {e}") from None
        return whole[len(opened):] if whole[:len(opened)] == opened else None

    def extension(self, new: list[Message], tools: list[ToolSpec]) -> list[int]:
        """The ids of `new` (the messages after an assistant turn) and of the next assistant turn's opening."""
        rendered = [self.fmt.template_message(m, tools) for m in new]
        try:
            with self._lock:
                return spliced_turns(self.tokenizer, rendered, self.closing, True, [t.openai() for t in tools] or None)
        except PromptEncodingError as e:
            if e.reason == "unsplicable_turn":
                raise bad_request(str(e)) from None
            raise bad_request(f"the model's chat template cannot encode these messages: {e}") from None

    def splice(self, action: list[int], new: list[Message], tools: list[ToolSpec]) -> list[int]:
        """The ids that follow the sampled turn `action`: what closes it, `new` (the messages after it) and
        the next assistant turn's opening; the model's own end token is not rendered again."""
        return splice_after_action(action, self.stop_ids, self.closing + self.extension(new, tools))

    def extend(self, held: list[int], action: list[int], new: list[Message], messages: list[Message],
               tools: list[ToolSpec]) -> list[int] | None:
        """The ids that take `held` (a segment's ids, ending with the sampled turn `action`) to the template's
        rendering of `messages` (the conversation, `new` its last messages) up to the next assistant turn's
        opening: the splice, or else the rest of that rendering's text after `held`'s (a template that renders
        what closes a turn by the turn's own content, e.g. `<|observation|>` after a tool-call turn in GLM-4.5's
        training variant). None when the template renders the conversation otherwise than `held` holds it (an
        earlier turn's reasoning dropped, a turn's text rewritten): the turn opens a new segment. Texts are
        compared, not ids, so a sampled turn the tokenizer would split otherwise still extends its segment."""
        rendered = [self.fmt.template_message(m, tools) for m in messages]
        with self._lock:  # (`encode`, a new segment, reports what the template cannot render)
            want = rendered_text(self.tokenizer, rendered, [t.openai() for t in tools] or None)
        if want is None:
            return None
        ids = self.splice(action, new, tools)
        with self._lock:
            return extend_to_rendering(self.tokenizer, held, ids, want)
