"""The environment loop under each chat template the project ships or is used with (the tiny model's,
SmolLM2's ChatML, GLM-4.5's, its training variant, GLM-4.7-Flash's), with and without reasoning, the
environment's results in the template's tool-result role or as user turns: every context the engine continues
is the template's own rendering of the conversation so far (the sampled turns as the assistant's text), token
for token; where the template renders the conversation otherwise than the episode holds it, the turn opens a
new segment, and the number of segments is the rule docs/agents.md states (context compaction's summary request
and the turns after its resume too). The sampled ids are the engine's, as produced, in the segment that sampled
them. The observation role renders the environment's text or is refused at start-up."""

import re

import pytest

import glmlight
from glmlight import compose
from glmlight.agents import AgentLoop, StepResult, encode_observation, episode_to_samples, generation_prompt
from glmlight.agents.compaction import CompactingAgentLoop
from glmlight.prompt import Prompt
from glmlight.engines.base import Generation, SamplingParams
from glmlight.errors import ConfigError
from glmlight.models.tokenizer import encode_chat, stop_token_ids
from glmlight.sample import Status
from tests.support.chat_templates import ANSWER_PREFIX, TOKENIZERS, TOOL_ROLE, end_token, glm45_tokenizer
from tests.support.glm_templates import GLM_TOKENIZERS
from tests.support.scripted_engine import ScriptedEngine
from tests.support.tool_env import ThreeTurnToolEnv

ALL_TOKENIZERS = {**TOKENIZERS, **GLM_TOKENIZERS}
GLM_CALL = "<tool_call>calc\n<arg_key>expr</arg_key>\n<arg_value>2*3</arg_value>\n</tool_call>"
GLM47_CALL = "<tool_call>calc<arg_key>expr</arg_key><arg_value>2*3</arg_value></tool_call>"

# segments of the episode (a tool call ended with the model's stop token, a turn cut by max_new_tokens, an answer;
# an observation after each of the first two), per template, whether the model reasons and the observations' role
# (`tool`: the template's tool-result role). GLM-4.5's templates drop the reasoning of turns before the last user
# turn (observations as user turns: a new segment at each); the training variant renders a turn whose call is in
# its text (no structured tool_calls) closed by `<|user|>`, where the model sampled `<|observation|>` (a new
# segment; the cut turn is closed by the rendering's rest); GLM-4.7's renders an earlier turn without kept
# reasoning as `</think>` alone where the model continued its generation prompt's `<think>`.
SEGMENTS = {
    ("tiny", False, "tool"): 1, ("tiny", False, "user"): 1, ("tiny", True, "tool"): 1, ("tiny", True, "user"): 1,
    ("smollm2", False, "tool"): 1, ("smollm2", False, "user"): 1,
    ("smollm2", True, "tool"): 1, ("smollm2", True, "user"): 1,
    ("glm45", False, "tool"): 1, ("glm45", False, "user"): 1, ("glm45", True, "tool"): 1, ("glm45", True, "user"): 3,
    ("glm45_training", False, "tool"): 2, ("glm45_training", False, "user"): 1,
    ("glm45_training", True, "tool"): 2, ("glm45_training", True, "user"): 3,
    ("glm47", False, "tool"): 3, ("glm47", False, "user"): 3, ("glm47", True, "tool"): 1, ("glm47", True, "user"): 3,
}


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def action_texts(name, think):
    """The model's three turns as text (a tool call, one cut short by max_new_tokens, an answer), as the model of
    template `name` writes them after the generation prompt."""
    bodies = [{"glm47": GLM47_CALL}.get(name, GLM_CALL if name.startswith("glm") else "calc: 2*3"), "calc: 6+",
              "answer: 6"]
    reason = [f"step {i}" if think else "" for i in range(3)]
    if name == "glm47":  # its generation prompt opens <think>: the model closes it
        return [r + "</think>" + b for r, b in zip(reason, bodies)]
    if name.startswith("glm"):
        return [f"\n<think>{r}</think>\n" + b for r, b in zip(reason, bodies)]
    return [(f"<think>{r}</think>" if think else "") + b for r, b in zip(reason, bodies)]


def run_episode(name, think, follow):
    """Three actions (a tool call the model ended with its stop token, one cut by max_new_tokens, an answer)."""
    tok = ALL_TOKENIZERS[name]()
    role = TOOL_ROLE.get(name, "tool") if follow == "tool" else "user"
    stop = end_token(name, tok, role)
    texts = action_texts(name, think)
    answers = [(_ids(tok, texts[0]) + [stop], "stop"), (_ids(tok, texts[1]), "length"),
               (_ids(tok, texts[2]) + [stop], "stop")]
    engine = ScriptedEngine(answers)
    params = lambda n: SamplingParams(max_new_tokens=64, stop_token_ids=stop_token_ids(tok))  # noqa: E731
    loop = AgentLoop(engine, tok, ThreeTurnToolEnv, params, max_turns=5, max_context=4096, observation_role=role)
    ep = loop.run([Prompt(messages=[{"role": "user", "content": "2*3?"}])])[0]
    return tok, role, texts, answers, engine, ep


@pytest.mark.parametrize("follow", ["tool", "user"])
@pytest.mark.parametrize("think", [False, True], ids=["plain", "reasoning"])
@pytest.mark.parametrize("name", ["tiny", "smollm2", "glm45", "glm45_training", "glm47"])
def test_every_context_is_the_templates_rendering_and_segments_follow_its_rewrites(name, think, follow):
    """With GLM's templates the stop token is the next turn's role marker (no end-of-turn text after an assistant
    turn), which the splice must not render again: the context after a turn ended with `<|observation|>` holds one
    `<|observation|>`, as the template's rendering does."""
    tok, role, texts, answers, engine, ep = run_episode(name, think, follow)
    assert ep.status is Status.COMPLETED and ep.turns == 3
    conversation = [{"role": "user", "content": "2*3?"}]
    for t, ctx in enumerate(engine.contexts):
        if t:
            conversation += [{"role": "assistant", "content": texts[t - 1]},
                             {"role": role, "content": f"tool says {5 + t}"}]
        expected = encode_chat(tok, conversation, add_generation_prompt=True)
        assert ctx == expected, (f"turn {t}: the context differs from the template's rendering\n"
                                 f"context:  {tok.decode(ctx)!r}\ntemplate: {tok.decode(expected)!r}")
    samples = episode_to_samples(ep, 0, 0)
    assert len(samples) == SEGMENTS[name, think, follow] == ep.info.get("rewrites", 0) + 1
    # each segment is the context of its last turn and that turn's sampled ids; the sampled ids of all segments
    # are the engine's, in order
    last = [t for t in range(3) for s in samples if s.prompt_ids + s.response_ids == engine.contexts[t] + answers[t][0]]
    assert len(last) == len(samples), "a segment is not the context of one of its turns and that turn's ids"
    assert [i for s in samples for i, m in zip(s.response_ids, s.loss_mask) if m] == [i for a, _ in answers for i in a]


@pytest.mark.parametrize("name, role", [("tiny", "observation"), ("smollm2", "observation"), ("glm45", "tool")])
def test_the_default_observation_role_renders_the_environments_text(name, role):
    """`observation_role` left at its default: each template gets a role that renders the tool result. With
    GLM-4.5's template (roles system, user, assistant, tool) the role `observation` rendered nothing and the
    tool result vanished from the context."""
    tok = TOKENIZERS[name]()
    stop = end_token(name, tok, role)
    answer = _ids(tok, ANSWER_PREFIX[name] + "calc: 2*3") + [stop]
    engine = ScriptedEngine([(answer, "stop")] * 3)
    params = lambda n: SamplingParams(max_new_tokens=32, stop_token_ids=stop_token_ids(tok))  # noqa: E731
    loop = AgentLoop(engine, tok, ThreeTurnToolEnv, params, max_turns=5, max_context=2048)
    assert loop.observation_role == role
    ep = loop.run([Prompt(messages=[{"role": "user", "content": "2*3?"}])])[0]
    spliced = tok.decode([i for i, m in zip(ep.response_ids, ep.loss_mask) if not m])
    assert "tool says 6" in spliced and "tool says 7" in spliced, spliced


def test_an_observation_role_that_renders_nothing_is_a_config_error():
    from glmlight.agents.observation_role import resolve_observation_role

    tok = glm45_tokenizer()
    message = ("config error: task.agent.observation_role=observation renders nothing under this chat template "
               "(it renders: system, user, assistant, tool); set task.agent.observation_role=tool")
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_observation_role(tok, "observation")
    with pytest.raises(ConfigError, match=re.escape(message)):
        AgentLoop(ScriptedEngine([]), tok, ThreeTurnToolEnv, lambda n: SamplingParams(), observation_role="observation")
    assert resolve_observation_role(tok, "auto") == "tool"
    assert resolve_observation_role(tok, "user") == "user"


def test_the_run_refuses_an_observation_role_the_template_drops_at_start_up(tmp_path):
    """glmlight.build with a checkpoint whose tokenizer has GLM-4.5's template: an agent task whose
    observation role renders nothing fails before anything runs, in one line; the default runs."""
    import torch
    import transformers as T

    tok = glm45_tokenizer()
    path = str(tmp_path / "glm45-template-llama")
    cfg = T.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, head_dim=16, pad_token_id=tok.pad_token_id,
                        eos_token_id=tok.eos_token_id, bos_token_id=None, max_position_embeddings=512,
                        tie_word_embeddings=False)
    torch.manual_seed(0)
    T.LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    tok.save_pretrained(path)
    overrides = ["model=hf", f"model.path={path}", "task=calculator_agent", "model.warm_start.steps=0",
                 "logger=none", f"trainer.default_root_dir={tmp_path}"]
    with pytest.raises(ConfigError, match=re.escape("config error: task.agent.observation_role=observation renders "
                                                    "nothing under this chat template")) as e:
        glmlight.build(compose([*overrides, "task.agent.observation_role=observation"]))
    assert "\n" not in str(e.value)
    run = glmlight.build(compose(overrides))
    assert run.datamodule.agent.observation_role == "tool"
    run.close()


class SummarisingPolicy:
    """An engine answering a context that ends with the summary request with 'S1', 'S2', ..., any other with
    a turn with reasoning ('r1', 'a1', ...) ended by `<|user|>` (GLM-4.5's stop token before a user turn)."""

    def __init__(self, tok, request):
        self.tok, self.request, self.actions, self.summaries, self.contexts = tok, request, 0, 0, []

    def generate(self, prompts, params):
        out = []
        for ctx in prompts:
            summary = ctx[-len(self.request):] == self.request
            self.contexts.append((list(ctx), summary))
            if summary:
                self.summaries += 1
                text = f"S{self.summaries}"
            else:
                self.actions += 1
                text = f"\n<think>r{self.actions}</think>\na{self.actions}"
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.convert_tokens_to_ids("<|user|>")]
            out.append(Generation(ids, [-0.5] * len(ids), "stop", [0] * len(ids)))
        return out


class Echo:
    def __init__(self):
        self.t = 0

    def reset(self, prompt):
        return [{"role": "user", "content": "go"}]

    def step(self, action):
        self.t += 1
        return StepResult(None, reward=1.0, done=True) if self.t >= 7 else StepResult(f"o{self.t}")


def test_compaction_asks_for_its_summary_in_the_templates_rendering_and_checks_the_turns_after_the_resume():
    """GLM-4.5's template, reasoning, observations as user turns: each turn's context is the template's rendering
    (a new segment each turn); the summary request, a user turn, is asked in the rendering of the conversation
    with it (the earlier reasoning dropped: a new segment); the resume prompt is CompactionRL's (it keeps the last
    step as produced, reasoning included), and the turn after it is checked against the rendering of the resumed
    conversation (the opening messages, the resume turn, the kept step)."""
    tok = glm45_tokenizer()
    request = encode_observation(tok, "Summarize.", role="user") + generation_prompt(tok)
    policy = SummarisingPolicy(tok, request)
    params = lambda n: SamplingParams(max_new_tokens=16, stop_token_ids=stop_token_ids(tok))  # noqa: E731
    loop = CompactingAgentLoop(policy, tok, Echo, params, max_turns=10, max_context=120, threshold=60,
                               keep_last_steps=1, summary_max_tokens=4, observation_role="user")
    ep = loop.run([Prompt(messages=[])])[0]
    assert ep.status is Status.COMPLETED and ep.turns == 7 and ep.info["compactions"] == 1
    turn = lambda i: [{"role": "assistant", "content": f"\n<think>r{i}</think>\na{i}"},  # noqa: E731
                      {"role": "user", "content": f"o{i}"}]
    summary_at = next(i for i, (_, s) in enumerate(policy.contexts) if s)
    assert summary_at == 5
    conversation = [{"role": "user", "content": "go"}]
    for i in range(1, summary_at + 1):
        ctx = policy.contexts[i - 1][0]
        assert ctx == encode_chat(tok, conversation, add_generation_prompt=True), tok.decode(ctx)
        conversation += turn(i)
    summary = encode_chat(tok, conversation + [{"role": "user", "content": "Summarize."}], add_generation_prompt=True)
    assert policy.contexts[summary_at][0] == summary, tok.decode(policy.contexts[summary_at][0])
    resumed = [{"role": "user", "content": "go"}, {"role": "user", "content": "Summary: S1"}, *turn(5), *turn(6)]
    assert policy.contexts[-1][0] == encode_chat(tok, resumed, add_generation_prompt=True)
    # a segment per turn (its reasoning dropped at the next user turn), the summary's, the resumed one's
    assert ep.info["rewrites"] == 6 and len(episode_to_samples(ep, 0, 0)) == 8
