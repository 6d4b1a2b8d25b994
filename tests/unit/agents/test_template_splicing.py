"""The environment loop under each chat template the project ships or is used with (the tiny model's,
SmolLM2's ChatML, GLM-4.5's): every context the engine continues is the template's own rendering of the
conversation so far, and the observation role renders the environment's text or is refused at start-up."""

import re

import pytest

import glmlight
from glmlight import compose
from glmlight.agents import AgentLoop, StepResult
from glmlight.data.sources import Prompt
from glmlight.engines.base import SamplingParams
from glmlight.errors import ConfigError
from glmlight.models.tokenizer import encode_chat, stop_token_ids
from glmlight.sample import Status
from tests.support.chat_templates import ANSWER_PREFIX, TOKENIZERS, TOOL_ROLE, end_token, glm45_tokenizer
from tests.support.scripted_engine import ScriptedEngine


class ToolEnv:
    """Answers the first two actions with a tool result; done after the third."""

    def __init__(self):
        self.t = 0

    def reset(self, prompt):
        return list(prompt.messages)

    def step(self, action):
        self.t += 1
        return StepResult(None, reward=1.0, done=True) if self.t >= 3 else StepResult(f"tool says {5 + self.t}")


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("follow", ["tool", "user"])
@pytest.mark.parametrize("name", ["tiny", "smollm2", "glm45"])
def test_every_context_is_the_templates_rendering_of_the_conversation(name, follow):
    """Three actions: one the model ended with its stop token, one cut by max_new_tokens, a final one. With
    GLM-4.5's template the stop token is the next turn's role marker (no end-of-turn text after an assistant
    turn), which must not be rendered again by the splice: the context after a turn ended with
    `<|observation|>` holds one `<|observation|>`, as the template's rendering does."""
    tok = TOKENIZERS[name]()
    role = TOOL_ROLE[name] if follow == "tool" else "user"
    stop = end_token(name, tok, role)
    texts = [ANSWER_PREFIX[name] + t for t in ("calc: 2*3", "calc: 6+", "answer: 7")]
    engine = ScriptedEngine([(_ids(tok, texts[0]) + [stop], "stop"), (_ids(tok, texts[1]), "length"),
                              (_ids(tok, texts[2]) + [stop], "stop")])
    params = lambda n: SamplingParams(max_new_tokens=32, stop_token_ids=stop_token_ids(tok))  # noqa: E731
    loop = AgentLoop(engine, tok, ToolEnv, params, max_turns=5, max_context=2048, observation_role=role)
    ep = loop.run([Prompt(messages=[{"role": "user", "content": "2*3?"}])])[0]
    assert ep.status is Status.COMPLETED and ep.turns == 3
    conversation = [{"role": "user", "content": "2*3?"}]
    for t, ctx in enumerate(engine.contexts):
        if t:
            conversation += [{"role": "assistant", "content": texts[t - 1]},
                             {"role": role, "content": f"tool says {5 + t}"}]
        expected = encode_chat(tok, conversation, add_generation_prompt=True)
        assert ctx == expected, (f"turn {t}: the context differs from the template's rendering\n"
                                 f"context:  {tok.decode(ctx)!r}\ntemplate: {tok.decode(expected)!r}")
    assert [i for i, m in zip(ep.response_ids, ep.loss_mask) if m] == [i for ids, _ in [
        (_ids(tok, texts[0]) + [stop], 0), (_ids(tok, texts[1]), 0), (_ids(tok, texts[2]) + [stop], 0)] for i in ids]


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
    loop = AgentLoop(engine, tok, ToolEnv, params, max_turns=5, max_context=2048)
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
        AgentLoop(ScriptedEngine([]), tok, ToolEnv, lambda n: SamplingParams(), observation_role="observation")
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
    assert run.datamodule.observation_role == "tool"
    run.close()
