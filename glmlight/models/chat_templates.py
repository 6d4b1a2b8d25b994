"""Chat templates a tokenizer can be given by name (`model.chat_template`), beside its own.

- `glm45`: GLM-4.5/4.6's template (`glm4moe.jinja`) as the `trl` wheel ships it (the `dev` extra). A GLM
  conversation starts with `[gMASK]<sop>`; an assistant turn has no end-of-turn text: the model ends it by
  sampling the next turn's role marker (`<|observation|>` before a tool result, `<|user|>` before a user
  turn); tool results are role `tool`; reasoning sits in `<think>...</think>`; tool calls are
  `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`.
- `glm45_training`: its prefix-preserving variant (`glm4moe_training.jinja`, beside it in the wheel).
- a path to a `.jinja` file: that file's text.

On glmlight's character tokenizer (the tiny models' tokenizer) a GLM template also adds GLM-4.5's added
tokens: its control tokens as special tokens (dropped from decoded text) and its reasoning and tool-call tags
as plain added tokens (an agent reads them in the decoded text), as in GLM-4.5's own tokenizer, so that what
the template renders splits at its markers as the real tokenizer splits it.
"""

from __future__ import annotations

import os

from tokenizers import AddedToken
from transformers import PreTrainedTokenizerBase

from glmlight.errors import ConfigError

GLM45_SPECIAL = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>"]
GLM45_TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
              "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]

# name -> the file in trl's chat_templates folder
TRL_TEMPLATES = {"glm45": "glm4moe.jinja", "glm45_training": "glm4moe_training.jinja"}


def template_text(name: str) -> str:
    """The text of the chat template `name` (one of TRL_TEMPLATES, or a .jinja file's path)."""
    if name in TRL_TEMPLATES:
        try:
            import trl
        except ImportError:
            raise ConfigError(f"config error: model.chat_template={name!r} is read from the `trl` package, which is "
                              "not installed: pip install 'glmlight[dev]' (or pip install trl)") from None
        path = os.path.join(os.path.dirname(trl.__file__), "chat_templates", TRL_TEMPLATES[name])
    elif name.endswith(".jinja"):
        path = name
    else:
        raise ConfigError(f"config error: model.chat_template={name!r} is neither one of {sorted(TRL_TEMPLATES)} "
                          "nor a path to a .jinja file")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"config error: model.chat_template={name!r}: cannot read {path} ({e.strerror})") from None


def is_glm(name: str | None) -> bool:
    return bool(name) and name in TRL_TEMPLATES


def with_chat_template(tokenizer: PreTrainedTokenizerBase, name: str, char_tokenizer: bool) -> PreTrainedTokenizerBase:
    """`tokenizer` rendering with the template `name`; on the character tokenizer, a GLM template brings GLM's
    added tokens (a checkpoint's own tokenizer already has its model's tokens)."""
    text = template_text(name)
    if char_tokenizer and is_glm(name):
        tokenizer.add_special_tokens({"additional_special_tokens": GLM45_SPECIAL})
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in GLM45_TAGS])
    tokenizer.chat_template = text
    return tokenizer


def glm45_tokenizer(training: bool = False) -> PreTrainedTokenizerBase:
    """glmlight's character tokenizer with GLM-4.5's template (`training`: the prefix-preserving variant)."""
    from glmlight.models.tokenizer import build_char_tokenizer

    return with_chat_template(build_char_tokenizer(), "glm45_training" if training else "glm45", char_tokenizer=True)
