"""Tokenizers: a local character-level tokenizer for the tiny default model, and
chat-template encoding that returns plain token-id lists."""

from __future__ import annotations

import string
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from glmlight.errors import ConfigError, DataError


class PromptEncodingError(DataError):
    """One prompt the chat template cannot turn into a usable prompt; `reason` is its drop-count name."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason

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
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template (with `tools`, the tool
    declarations the template renders, in the OpenAI function-tool form; a template without tool
    support ignores them). With `continue_final_message` the last message is left open, its text the
    end of the ids (a turn that continues it; `add_generation_prompt` must be False).

    A tokenizer without a chat template is a ConfigError; messages the template or the tokenizer
    cannot encode (a template error, characters outside the vocabulary) raise PromptEncodingError."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ConfigError(f"config error: the tokenizer {name!r} has no chat template; set tokenizer.chat_template, "
                          "or use a checkpoint whose tokenizer_config.json (or chat_template.jinja) has one")
    try:
        extra = {"tools": tools} if tools else {}
        if continue_final_message:
            extra["continue_final_message"] = True
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            **extra)
    except Exception as e:  # noqa: BLE001 - jinja, the tokenizers library and transformers raise many kinds
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise PromptEncodingError("unencodable_prompt", f"the chat template cannot encode the prompt "
                                  f"{_preview(messages)} ({type(e).__name__}: {first})") from None
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(i) for i in out]


def encode_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> list[int]:
    """`encode_chat` with the generation prompt, for a prompt the policy answers: raises
    PromptEncodingError("empty_prompt") when it renders to no tokens or its text decodes to nothing
    (only template and special tokens left, e.g. every character outside the vocabulary)."""
    ids = encode_chat(tokenizer, messages, add_generation_prompt=True)
    if not ids or not tokenizer.decode(ids, skip_special_tokens=True).strip():
        raise PromptEncodingError("empty_prompt", f"the prompt {_preview(messages)} decodes to nothing after the "
                                  f"chat template ({len(ids)} tokens, all of them template or special tokens)")
    return ids


def _preview(messages: list[dict[str, Any]]) -> str:
    text = " | ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    return repr(text[:60] + ("..." if len(text) > 60 else ""))


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end an assistant turn: eos plus any role marker that would open a new turn."""
    ids = {tokenizer.eos_token_id}
    for t in ("<|user|>", "<|observation|>", "<|endoftext|>"):
        i = tokenizer.convert_tokens_to_ids(t)
        if isinstance(i, int) and i != tokenizer.unk_token_id and i is not None:
            ids.add(i)
    return sorted(i for i in ids if i is not None)


# Two renderings of one short conversation whose assistant texts differ: what they share at their end is
# what the template puts after an assistant turn's text, and what it renders after that turn is the same
# in both. Splicing a turn after an episode's ids renders it after this conversation, so that what the
# template adds at the start of a conversation (a default system prompt, a BOS) is never repeated.
SPLICE_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
SPLICE_BASE_LONGER = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "yz"}]


def common_tail(a: list[int], b: list[int]) -> list[int]:
    """The longest common suffix of `a` and `b`."""
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return a[len(a) - n:]


def assistant_closing(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """What the chat template puts after an assistant turn's text whatever follows it: its end-of-turn token
    and what follows that (ChatML: `<|im_end|>` and a newline; GLM-4.5's template: nothing, the next turn's
    role marker ends the turn)."""
    return common_tail(encode_chat(tokenizer, SPLICE_BASE, False), encode_chat(tokenizer, SPLICE_BASE_LONGER, False))


def turn_closing(tokenizer: PreTrainedTokenizerBase, role: str) -> list[int]:
    """What the chat template puts after the text of a `role` turn that ends a conversation (ChatML:
    `<|im_end|>` and a newline; GLM's template: nothing)."""
    return common_tail(encode_chat(tokenizer, [*SPLICE_BASE, {"role": role, "content": "x"}], False),
                       encode_chat(tokenizer, [*SPLICE_BASE, {"role": role, "content": "xy"}], False))


def spliced_turns(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], closing: list[int],
                  add_generation_prompt: bool = False, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The ids of `messages` as the template renders them after an assistant turn (and, with
    `add_generation_prompt`, the next assistant turn's opening), less the assistant turn's `closing`.
    PromptEncodingError when the template closes an assistant turn otherwise once more messages follow."""
    tail = common_tail(encode_chat(tokenizer, SPLICE_BASE + messages, add_generation_prompt, tools),
                       encode_chat(tokenizer, SPLICE_BASE_LONGER + messages, add_generation_prompt, tools))
    if tail[: len(closing)] != closing:
        raise PromptEncodingError("unsplicable_turn", "the model's chat template closes an assistant turn "
                                  "differently when more messages follow; these messages cannot be appended "
                                  "to the episode")
    return tail[len(closing):]


def splice_after_action(action: list[int], stop_ids: set[int], rendered: list[int]) -> list[int]:
    """The ids that follow a sampled assistant turn `action` in an episode, given `rendered`: what the chat
    template puts after that turn's text (its closing, then the turns that follow; `assistant_closing` +
    `spliced_turns`).

    A turn the model ended with a stop token that is the first token of `rendered` gets the rest: that
    token is already in the episode, sampled. It is the end-of-turn token of a template that closes an
    assistant turn with one (the tiny model's `<eos>`, ChatML's `<|im_end|>`, followed by its newline), or
    the next turn's role marker of a template that closes it with nothing (GLM-4.5's `<|observation|>`
    before a tool result, `<|user|>` before a user turn). A turn cut without one (max_new_tokens, a stop
    string), or ended with a stop token the template does not put there, gets all of `rendered`, so that the
    next turn starts where the template starts one."""
    ended = bool(action) and action[-1] in stop_ids and rendered[:1] == action[-1:]
    return list(rendered[1:] if ended else rendered)


def rendered_text(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None = None) -> str | None:
    """The chat template's text of `messages` up to the opening of the next assistant turn; None when the
    template cannot render them (`encode_chat`, which a new segment is encoded with, reports why)."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **({"tools": tools} if tools else {}))
    except Exception:  # noqa: BLE001 - jinja and transformers raise many kinds
        return None
    return text if isinstance(text, str) else None


def extend_to_rendering(tokenizer: PreTrainedTokenizerBase, held: list[int], spliced: list[int],
                        want: str | None) -> list[int] | None:
    """The ids that take `held` (a segment's ids) to `want` (the template's text of the conversation,
    `rendered_text`): `spliced` (the turns spliced after the last sampled turn) when `held` + `spliced` is that
    text, or else the rest of `want` after `held`'s text (a template that renders what closes a turn by the
    turn's own content, e.g. `<|observation|>` after a tool-call turn in GLM-4.5's training variant). None when
    `want` does not continue `held`'s text (the template renders an earlier turn otherwise than `held` holds it:
    the turn opens a new segment). Texts are compared, not ids, so a sampled turn the tokenizer would split
    otherwise still extends its segment."""
    if want is None:
        return None
    text = lambda ids: tokenizer.decode(ids, skip_special_tokens=False,  # noqa: E731
                                        clean_up_tokenization_spaces=False)
    if text(held + spliced) == want:
        return list(spliced)
    have = text(held)
    if not want.startswith(have):
        return None
    rest = list(tokenizer(want[len(have):], add_special_tokens=False)["input_ids"])
    return rest if text(held + rest) == want else None
