"""The splice rule of glmlight.models.tokenizer under each chat template the project ships or is used with
(the tiny model's, SmolLM2's ChatML, GLM-4.5's): a sampled assistant turn followed by the splice is the
template's rendering of the conversation, whichever token ended the turn."""

import pytest

from glmlight.models.tokenizer import (assistant_closing, encode_chat, splice_after_action, spliced_turns,
                                       stop_token_ids)
from tests.support.chat_templates import ANSWER_PREFIX, TOKENIZERS, TOOL_ROLE, end_token


@pytest.mark.parametrize("ended", [True, False], ids=["ended", "cut"])
@pytest.mark.parametrize("follow", ["tool", "user"])
@pytest.mark.parametrize("name", ["tiny", "smollm2", "glm45"])
def test_a_spliced_turn_is_the_templates_rendering(name, follow, ended):
    """Ended: the model's stop token is the first token the template renders after the turn's text (the tiny
    model's <eos>, ChatML's <|im_end|>, GLM-4.5's next role marker) and is not rendered again. Cut: the splice
    adds all of what the template puts there."""
    tok = TOKENIZERS[name]()
    role = TOOL_ROLE[name] if follow == "tool" else "user"
    text = ANSWER_PREFIX[name] + "calc: 2*3"
    opening = [{"role": "user", "content": "2*3?"}]
    action = tok(text, add_special_tokens=False)["input_ids"] + ([end_token(name, tok, role)] if ended else [])
    closing = assistant_closing(tok)
    following = [{"role": role, "content": "6"}]
    rendered = closing + spliced_turns(tok, following, closing, add_generation_prompt=True)
    episode = encode_chat(tok, opening) + action + splice_after_action(action, set(stop_token_ids(tok)), rendered)
    assert episode == encode_chat(tok, [*opening, {"role": "assistant", "content": text}, *following])


def test_a_stop_token_the_template_does_not_put_there_stays_part_of_the_turn():
    """GLM-4.5: a turn ended with `<|user|>` followed by a tool result keeps its `<|user|>` (sampled) and gets
    the whole rendering of the tool turn after it; a turn ended with the `<|observation|>` the template puts
    there gets the rest."""
    tok = TOKENIZERS["glm45"]()
    user, obs = tok.convert_tokens_to_ids("<|user|>"), tok.convert_tokens_to_ids("<|observation|>")
    rendered = spliced_turns(tok, [{"role": "tool", "content": "6"}], assistant_closing(tok))
    assert assistant_closing(tok) == [] and rendered[0] == obs
    stops = set(stop_token_ids(tok))
    assert {user, obs} <= stops
    assert splice_after_action([7, user], stops, rendered) == rendered
    assert splice_after_action([7, obs], stops, rendered) == rendered[1:]
    assert splice_after_action([], stops, rendered) == rendered
