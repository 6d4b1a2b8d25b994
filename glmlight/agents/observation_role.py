"""The chat-template role of an environment's observations (`task.agent.observation_role`).

A template renders only the roles it knows: GLM-4.5's knows system, user, assistant and tool, and
renders a turn of any other role (`observation`) as nothing, so the observation would vanish from the
episode. A role that renders nothing of the observation's text is therefore a ConfigError at start-up.
`auto` (the default) takes the first of `observation` (GLM's own tool-result turn, the tiny model's
`<|observation|>`), `tool` (the OpenAI role of a tool result: GLM-4.5/4.6, Qwen and most recent
templates) and `user` that the template renders. A template that renders any role name as it is
(ChatML, the tiny model's) thus keeps `observation`; set `user` or `tool` for a model that was never
trained on such turns (the SmolLM2 recipes set `user`).
"""

from __future__ import annotations

from typing import Any

from glmlight.errors import ConfigError
from glmlight.models.tokenizer import assistant_closing, spliced_turns

AUTO_ORDER = ("observation", "tool", "user")
# the roles a start-up error lists as those the template renders
PROBED_ROLES = ("system", "user", "assistant", "tool", "observation", "function", "ipython")


def renders(tokenizer: Any, role: str, closing: list[int] | None = None) -> bool:
    """Whether the chat template renders the text of a `role` turn that follows an assistant turn."""
    closing = assistant_closing(tokenizer) if closing is None else closing
    try:
        a, b = (spliced_turns(tokenizer, [{"role": role, "content": text}], closing) for text in ("x", "xy"))
    except Exception:  # noqa: BLE001 - a template that refuses the role (raise_exception) does not render it
        return False
    return a != b


def resolve_observation_role(tokenizer: Any, role: str) -> str:
    """`role` (`auto`: the first of AUTO_ORDER the template renders), checked to render the observation's
    text under the tokenizer's chat template; ConfigError (one line) when it renders nothing."""
    closing = assistant_closing(tokenizer)
    if role != "auto" and renders(tokenizer, role, closing):
        return role
    if role == "auto":
        for candidate in AUTO_ORDER:
            if renders(tokenizer, candidate, closing):
                return candidate
    known = [r for r in PROBED_ROLES if renders(tokenizer, r, closing)]
    fix = next((r for r in AUTO_ORDER if r in known), None)
    raise ConfigError(f"config error: task.agent.observation_role={role} renders nothing under this chat template "
                      f"(it renders: {', '.join(known) or 'none of ' + ', '.join(PROBED_ROLES)})"
                      + (f"; set task.agent.observation_role={fix}" if fix else ""))
