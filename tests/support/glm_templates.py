"""Character tokenizers with the GLM chat templates beyond GLM-4.5's own (`tests.support.chat_templates`):
its prefix-preserving training variant and GLM-4.7's.

- `glm45_training`: `glm4moe_training.jinja` from the installed `trl` wheel (trl 1.16): GLM-4.5's template with
  `{% generation %}` markers, and the marker that ends an assistant turn (`<|observation|>` after tool calls,
  else `<|user|>` or `<|system|>`) rendered as part of that turn.
- `glm47`: GLM-4.7-Flash's template (`templates/glm47_flash.jinja`), copied unchanged from
  `vendor/llama.cpp/models/templates/GLM-4.7-Flash.jinja` in the `llama-cpp-python` 0.3.36 sdist (MIT): no
  newlines between a call's name and its argument tags, a generation prompt that opens `<think>`, and an
  earlier turn without kept reasoning rendered with `</think>` alone.

No registry package ships a GLM-5 Jinja template (SGLang 0.5.23 has a Python rendering of GLM-5.3's,
`sglang/srt/parser/glm53_chat_template.py`, which the tests do not import)."""

from __future__ import annotations

import os

from tests.support.chat_templates import glm45_tokenizer

GLM47_TEMPLATE_FILE = os.path.join(os.path.dirname(__file__), "templates", "glm47_flash.jinja")


def glm45_training_template() -> str:
    """`glm4moe_training.jinja` as the `trl` wheel ships it."""
    import trl

    with open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", "glm4moe_training.jinja")) as f:
        return f.read()


def glm47_template() -> str:
    with open(GLM47_TEMPLATE_FILE) as f:
        return f.read()


def glm45_training_tokenizer():
    """GLM-4.5's vocabulary with `glm4moe_training.jinja`."""
    tok = glm45_tokenizer()
    tok.chat_template = glm45_training_template()
    return tok


def glm47_tokenizer():
    """GLM-4.5's vocabulary (GLM-4.7 has the same markers and tags) with GLM-4.7-Flash's template."""
    tok = glm45_tokenizer()
    tok.chat_template = glm47_template()
    return tok


GLM_TOKENIZERS = {"glm45": glm45_tokenizer, "glm45_training": glm45_training_tokenizer, "glm47": glm47_tokenizer}
