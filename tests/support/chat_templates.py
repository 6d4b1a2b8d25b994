"""Character tokenizers with the chat templates the project ships or is used with: the tiny model's
(glmlight's own), SmolLM2-Instruct's ChatML and GLM-4.5/4.6's (`glm4moe.jinja`, read from the installed
`trl` package, a dev extra). Each vocabulary has the template's special tokens, so that what a template
renders tokenizes as the real model's tokenizer would split it at its markers."""

from __future__ import annotations

from glmlight.models.chat_templates import GLM45_SPECIAL, GLM45_TAGS, glm45_tokenizer  # noqa: F401 - fixtures
from glmlight.models.chat_templates import template_text
from glmlight.models.tokenizer import build_char_tokenizer

# SmolLM2-135M-Instruct's chat template, as its tokenizer_config.json has it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_tokenizer():
    """The tiny model's tokenizer and template (<eos> closes an assistant turn)."""
    return build_char_tokenizer()


def smollm2_tokenizer():
    """ChatML as SmolLM2-Instruct has it: a default system prompt, `<|im_end|>` (its eos) and a newline
    after every turn."""
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = SMOLLM2_TEMPLATE
    return tok


def glm45_template() -> str:
    """GLM-4.5/4.6's chat template as the `trl` wheel ships it."""
    return template_text("glm45")


TOKENIZERS = {"tiny": tiny_tokenizer, "smollm2": smollm2_tokenizer, "glm45": glm45_tokenizer}

# The role of a tool result (an environment's observation) each template knows.
TOOL_ROLE = {"tiny": "observation", "smollm2": "tool", "glm45": "tool"}

# What a GLM-4.5 answer without reasoning starts with (its template renders an assistant turn so).
ANSWER_PREFIX = {"tiny": "", "smollm2": "", "glm45": "\n<think></think>\n"}


def end_token(name: str, tok, following_role: str) -> int:
    """The token a model of template `name` ends an assistant turn with when a `following_role` turn comes
    next: its end-of-turn token (tiny: <eos>, ChatML: <|im_end|>), or for GLM-4.5 the next turn's role marker
    (`<|observation|>` before a tool result, `<|user|>` before a user turn; GLM-4.5's training variant and
    GLM-4.7's alike)."""
    if not name.startswith("glm"):
        return tok.eos_token_id
    return tok.convert_tokens_to_ids("<|observation|>" if following_role == "tool" else "<|user|>")
