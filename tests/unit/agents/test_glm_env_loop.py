"""The environment loop under GLM's chat templates with reasoning and two parallel tool calls in a turn, the
environment's results in role `tool`: every context the engine continues is the template's own rendering of the
conversation (the sampled turns as the assistant's content), one segment: the templates render these
conversations as one growing prefix (GLM-4.5's with or without reasoning, GLM-4.7's when the model reasons). Where
a template rewrites history the turn opens a new segment (tests/unit/agents/test_template_splicing.py)."""

import pytest

from glmlight.agents import AgentLoop
from glmlight.prompt import Prompt
from glmlight.engines.base import SamplingParams
from glmlight.models.tokenizer import encode_chat, stop_token_ids
from tests.support.tool_env import ThreeTurnToolEnv
from tests.support.glm_templates import GLM_TOKENIZERS
from tests.support.scripted_engine import ScriptedEngine

CALLS = {"glm45": ("<tool_call>calc\n<arg_key>expr</arg_key>\n<arg_value>2*3</arg_value>\n</tool_call>\n"
                   "<tool_call>calc\n<arg_key>expr</arg_key>\n<arg_value>4+5</arg_value>\n</tool_call>"),
         "glm47": ("<tool_call>calc<arg_key>expr</arg_key><arg_value>2*3</arg_value></tool_call>"
                   "<tool_call>calc<arg_key>expr</arg_key><arg_value>4+5</arg_value></tool_call>")}


class TwoToolTurns(ThreeTurnToolEnv):
    observation = "6 and 9 ({t})"


@pytest.mark.parametrize("name, think", [("glm45", False), ("glm45", True), ("glm47", True)])
def test_tool_turns_with_reasoning_are_the_templates_rendering(name, think):
    tok = GLM_TOKENIZERS[name]()
    reason = (lambda i: f"step {i}") if think else (lambda i: "")  # noqa: E731
    if name == "glm47":  # the generation prompt opens <think>: the model writes its reasoning and </think>
        texts = [reason(i) + "</think>" + b for i, b in enumerate((CALLS[name], CALLS[name], "done"))]
    else:
        texts = [f"\n<think>{reason(i)}</think>\n" + b for i, b in enumerate((CALLS[name], CALLS[name], "done"))]
    stop = tok.convert_tokens_to_ids("<|observation|>")
    engine = ScriptedEngine([(tok(t, add_special_tokens=False)["input_ids"] + [stop], "stop") for t in texts])
    params = lambda n: SamplingParams(max_new_tokens=128, stop_token_ids=stop_token_ids(tok))  # noqa: E731
    loop = AgentLoop(engine, tok, TwoToolTurns, params, max_turns=5, max_context=4096, observation_role="tool")
    ep = loop.run([Prompt(messages=[{"role": "user", "content": "2*3 and 4+5?"}])])[0]
    assert ep.turns == 3 and not ep.segments
    conversation = [{"role": "user", "content": "2*3 and 4+5?"}]
    for t, ctx in enumerate(engine.contexts):
        if t:
            sampled = ("<think>" if name == "glm47" else "") + texts[t - 1]
            conversation += [{"role": "assistant", "content": sampled}, {"role": "tool", "content": f"6 and 9 ({t})"}]
        expected = encode_chat(tok, conversation, add_generation_prompt=True)
        assert ctx == expected, (f"turn {t}\ncontext:  {tok.decode(ctx)!r}\ntemplate: {tok.decode(expected)!r}")
