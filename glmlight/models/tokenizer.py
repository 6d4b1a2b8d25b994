"""Tokenizers: a local character-level tokenizer for the tiny default model, and
chat-template encoding that returns plain token-id lists."""

from __future__ import annotations

import string
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]

# GLM-style role markers; the assistant turn ends with <eos>, which is the stop token.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}<eos>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character plus GLM-style role tokens; built locally."""
    chars = list(string.printable[:95]) + ["\n"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def encode_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(i) for i in out]


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end an assistant turn: eos plus any role marker that would open a new turn."""
    ids = {tokenizer.eos_token_id}
    for t in ("<|user|>", "<|observation|>", "<|endoftext|>"):
        i = tokenizer.convert_tokens_to_ids(t)
        if isinstance(i, int) and i != tokenizer.unk_token_id and i is not None:
            ids.add(i)
    return sorted(i for i in ids if i is not None)
