"""Multi-turn tool episodes through the agent gateway under GLM's chat templates (GLM-4.5's `glm4moe.jinja`, its
training variant `glm4moe_training.jinja`, GLM-4.7-Flash's), with and without reasoning: two parallel tool calls,
their results, an answer, a new user turn, an answer. Every context the engine continues is the template's own
rendering of the conversation, token for token; where the template renders the conversation otherwise than the
record holds it (an earlier turn's reasoning dropped, GLM-4.7's `</think>` for a turn without kept reasoning),
the turn opens a new segment, and the number of segments is the rule docs/agents.md states."""

import json
from collections import Counter

import openai
import pytest

from glmlight.agents.loop import episode_to_samples
from glmlight.prompt import Prompt
from glmlight.engines.base import SamplingParams
from glmlight.gateway.runner import GatewayOptions, GatewayRollout
from glmlight.models.tokenizer import encode_chat, stop_token_ids
from glmlight.sample import Status
from tests.support.glm_templates import GLM_TOKENIZERS
from tests.support.scripted_engine import ScriptedEngine

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "exact value", "parameters": {
    "type": "object", "properties": {"expr": {"type": "string"}, "digits": {"type": "integer"}}}}}]
CALLS = [{"expr": "2*3", "digits": 2}, {"expr": "4+5"}]

# segments of the episode, per template and whether the model reasons: GLM-4.5's templates drop the reasoning of
# turns before the last user turn (a new segment at the second user turn); GLM-4.7's also renders a turn without
# kept reasoning as `</think>` where the model continued its generation prompt's `<think>` (a new segment each turn)
SEGMENTS = {("glm45", False): 1, ("glm45", True): 2, ("glm45_training", False): 1, ("glm45_training", True): 2,
            ("glm47", False): 3, ("glm47", True): 2}


def _assistant(reasoning, content, calls=()):
    m = {"role": "assistant", "content": content}
    if reasoning:
        m["reasoning_content"] = reasoning
    if calls:
        m["tool_calls"] = [{"id": f"c{i}", "type": "function", "function": {"name": "calc", "arguments": a}}
                           for i, a in enumerate(calls)]
    return m


def conversation(think):
    r = (lambda s: s) if think else (lambda s: "")  # noqa: E731
    return [{"role": "user", "content": "2*3 and 4+5?"}, _assistant(r("two sums"), "", CALLS),
            {"role": "tool", "tool_call_id": "c0", "content": "6"}, {"role": "tool", "tool_call_id": "c1", "content": "9"},
            _assistant(r("both known"), "6 and 9."), {"role": "user", "content": "Double both?"},
            _assistant(r("doubling"), "12 and 18.")]


def sampled_turns(tok, conv):
    """The model's answers (ids, finish reason): each assistant turn's text as the template renders it after the
    generation prompt (less what the generation prompt already opened, e.g. GLM-4.7's `<think>`), ended with the
    role marker of the turn that follows (the template's own, or none: the model's stop token)."""
    render = lambda msgs, gen: tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=gen,  # noqa: E731
                                                        tokenize=False)
    answers = []
    for i, follow in ((1, "<|observation|>"), (4, "<|user|>"), (6, "<|user|>")):
        opened = render(conv[:i], True)
        at = opened.rindex("<|assistant|>") + len("<|assistant|>")
        text = render(conv[:i + 1], False)[at:]
        text = text[len(opened[at:]):] if text.startswith(opened[at:]) else text
        text = text.removesuffix(follow)  # the training variant renders the marker as part of the turn
        answers.append((tok(text, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(follow)], "stop"))
    return answers


def run_episode(name, think):
    tok = GLM_TOKENIZERS[name]()
    conv = conversation(think)
    answers = sampled_turns(tok, conv)
    engine = ScriptedEngine(answers)
    seen = {}

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            msgs = list(task.messages)
            m = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS).choices[0].message
            seen["calls"] = [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls]
            msgs += [m.model_dump(exclude_none=True)] + [{"role": "tool", "tool_call_id": t.id, "content": v}
                                                         for t, v in zip(m.tool_calls, "69")]
            m = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS).choices[0].message
            seen["answer"] = m.content
            msgs += [m.model_dump(exclude_none=True), {"role": "user", "content": "Double both?"}]
            seen["final"] = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS).choices[0].message.content

    params = lambda n: SamplingParams(max_new_tokens=256, stop_token_ids=stop_token_ids(tok))  # noqa: E731
    (ge,) = GatewayRollout(engine, tok, GatewayOptions(agent=agent), params, 4, 4096, Counter()).run(
        [Prompt(messages=[{"role": "user", "content": "2*3 and 4+5?"}])])
    return tok, conv, engine, ge, seen, answers


@pytest.mark.parametrize("think", [False, True], ids=["plain", "reasoning"])
@pytest.mark.parametrize("name", ["glm45", "glm45_training", "glm47"])
def test_every_context_is_the_templates_rendering_and_segments_follow_its_rewrites(name, think):
    tok, conv, engine, ge, seen, answers = run_episode(name, think)
    assert ge.ep.status is Status.COMPLETED and ge.ep.turns == 3, ge.failure
    assert seen["calls"] == [("calc", a) for a in CALLS]
    assert seen["answer"].endswith("6 and 9.") and seen["final"].endswith("12 and 18.")
    assert len(engine.contexts) == 3
    for ctx, upto in zip(engine.contexts, (1, 4, 6)):
        expected = encode_chat(tok, conv[:upto], add_generation_prompt=True, tools=TOOLS)
        assert ctx == expected, (f"after {upto} messages the context differs from the template's rendering\n"
                                 f"context:  {tok.decode(ctx)!r}\ntemplate: {tok.decode(expected)!r}")
    samples = episode_to_samples(ge.ep, 0, 0)
    assert len(samples) == SEGMENTS[name, think] == ge.rewrites + 1
    # each segment is the template's rendering of the conversation up to its last turn (its prompt and response)
    assert samples[-1].prompt_ids + samples[-1].response_ids == engine.contexts[-1] + answers[-1][0]
