"""Bad input gets one clear line or a counted skip: a prompt file that changes under a running job, prompts
the chat template cannot use, a tokenizer without a chat template, checkpoint directories that cannot serve,
environments that answer with the wrong types. Real engine, real tiny GLM-5, real checkpoints on disk."""

import json
import logging
import os
import shutil
import subprocess
import sys
from collections import Counter

import pytest

import glmlight
from glmlight import compose
from glmlight.agents import AgentLoop, StepResult
from glmlight.config.rollout import RolloutConfig
from glmlight.agents.options import AgentOptions
from glmlight.data.rollout import RolloutDataModule
from glmlight.data.sources import FileSource, ListSource
from glmlight.prompt import Prompt
from glmlight.errors import ConfigError, DataError
from glmlight.models.loading import load_causal_lm, load_tokenizer, save_checkpoint
from glmlight.models.tokenizer import build_char_tokenizer, encode_chat
from glmlight.engines.base import SamplingParams
from glmlight.engines.local.engine import LocalEngine
from glmlight.sample import Status
from tests.conftest import REPO, overrides_for_tests


def _lines(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _prompt(text):
    return Prompt(messages=[{"role": "user", "content": text}], label="1")


# ----------------------------------------------------------------------------------------- prompt files
def test_a_prompt_file_changed_under_a_running_job_is_noticed_once_and_the_snapshot_kept(tmp_path, caplog):
    path = tmp_path / "p.jsonl"
    _lines(path, [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": "4"}])
    src = FileSource(str(path))
    assert src.check_file(force=True) and src.changes_seen == 0
    _lines(path, [{"prompt": "9+9=", "label": "18"}])
    with caplog.at_level(logging.WARNING, logger="glmlight.data.sources"):
        assert not src.check_file(force=True)
        assert src.check_file(force=True)  # the same change is reported once
    assert src.changes_seen == 1
    assert len(src) == 2 and src[1].messages[0]["content"] == "2+2="  # the run keeps what it read
    assert [r.message for r in caplog.records if "changed on disk" in r.message] and \
        "keeps the 2 prompts it read" in caplog.records[0].message


def test_resuming_on_a_changed_prompt_file_stops_with_one_line(tmp_path):
    path = tmp_path / "train.jsonl"
    _lines(path, [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(8)])
    extra = ["task=jsonl", f"task.path={path}", "trainer.checkpoint_every_n_steps=1", "~callbacks.held_out_eval",
             "~callbacks.sample_table", "trainer.max_steps=1"]
    glmlight.build(compose(overrides_for_tests(tmp_path, *extra))).fit()
    _lines(path, [{"prompt": f"{i}+2=", "label": str(i + 2)} for i in range(9)])  # edited after the checkpoint
    resumed = glmlight.build(compose(overrides_for_tests(tmp_path, *extra[:-1], "trainer.max_steps=2",
                                                         "trainer.resume=last")))
    with pytest.raises(DataError) as err:
        resumed.fit()
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and "8 prompts" in msg and "9 prompts" in msg
    assert "not what this checkpoint was trained on" in msg


def test_a_prompt_of_empty_messages_is_named_with_its_line(tmp_path):
    path = tmp_path / "p.jsonl"
    _lines(path, [{"prompt": "ok"}, {"prompt": [{"role": "system", "content": ""}, {"role": "user", "content": " "}]}])
    with pytest.raises(DataError, match=r"p.jsonl:2: empty prompt \(every message's content is empty\)"):
        FileSource(str(path))


def test_prompts_the_chat_template_cannot_use_are_counted_skips(tokenizer, tiny_model):
    # "你好" has no token in the character vocabulary; "   " renders to role markers only
    source = ListSource([_prompt("1+2="), _prompt("你好"), _prompt("   "), _prompt("3+4=")])
    cfg = RolloutConfig(rollout_batch_size=4, n_samples_per_prompt=2, max_new_tokens=3, seed=1)
    engine = LocalEngine(tiny_model)
    try:
        dm = RolloutDataModule(engine, tokenizer, source, lambda s: 0.5, cfg)
        dm.stream.index = lambda k: k % 4  # the four prompts in order
        exp = dm.next_experience()
    finally:
        engine.close()
    totals = dm.totals
    assert totals["dropped/unencodable_prompt"] == 2 and totals["dropped/empty_prompt"] == 2
    assert totals["trained"] == 4 and exp.batch_size == 4
    assert totals["produced"] == totals["trained"] + sum(v for k, v in totals.items() if k.startswith("dropped/"))
    assert exp.stats["rollout/dropped/empty_prompt"] == 2.0


# ------------------------------------------------------------------------------------------- tokenizers
def test_a_tokenizer_without_a_chat_template_is_one_line():
    tok = build_char_tokenizer()
    tok.chat_template = None
    with pytest.raises(ConfigError, match="has no chat template; set tokenizer.chat_template") as err:
        encode_chat(tok, [{"role": "user", "content": "hi"}])
    assert "\n" not in str(err.value)


def test_a_checkpoint_tokenizer_without_a_chat_template_gets_the_glm_one_with_a_warning(tmp_path, caplog):
    tok = build_char_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(str(tmp_path))
    for f in ("chat_template.jinja", "chat_template.json"):
        if os.path.exists(tmp_path / f):
            os.remove(tmp_path / f)
    with caplog.at_level(logging.WARNING, logger="glmlight.models.loading"):
        loaded = load_tokenizer(str(tmp_path))
    assert loaded.chat_template and any("has no chat template" in r.message for r in caplog.records)


# ------------------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tok = build_char_tokenizer()
    model = load_causal_lm(None, tok, preset="test", seed=0)
    path = str(tmp_path_factory.mktemp("ckpt") / "model")
    save_checkpoint(model, tok, path)
    return path


def _copy(checkpoint, tmp_path, edit_config=None, drop=()):
    out = tmp_path / "copy"
    shutil.copytree(checkpoint, out)
    if edit_config is not None:
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(edit_config(cfg)))
    for name in drop:
        os.remove(out / name)
    return str(out)


def _load(path):
    return load_causal_lm(path, load_tokenizer(path))


def test_a_checkpoint_loads(checkpoint):
    assert _load(checkpoint).config.num_hidden_layers >= 1


@pytest.mark.parametrize("edit, drop, message", [
    (None, ("tokenizer.json",), "has no tokenizer (none of tokenizer.json"),
    (lambda c: {}, (), "config.json has no model_type"),
    (None, ("config.json",), "has no config.json"),
    (None, ("model.safetensors",), "has no safetensors weights"),
    (lambda c: {**c, "intermediate_size": 2 * c["intermediate_size"]}, (),
     "config.json and the weights disagree: model.layers.0.mlp."),
    (lambda c: {**c, "num_hidden_layers": 1, **{k: v[:1] for k, v in c.items() if k.endswith("layer_types")}}, (),
     "config.json and the weights disagree: the weights hold layers beyond num_hidden_layers=1"),
])
def test_a_checkpoint_that_cannot_serve_is_one_line_naming_directory_and_problem(checkpoint, tmp_path, edit, drop,
                                                                                  message):
    path = _copy(checkpoint, tmp_path, edit, drop)
    with pytest.raises(ConfigError) as err:
        _load(path)
    assert message in str(err.value) and f"model.path={path!r}" in str(err.value)
    assert "\n" not in str(err.value)


def test_weights_missing_a_tensor_are_refused(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _copy(checkpoint, tmp_path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    del weights["model.layers.0.mlp.down_proj.weight"]
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"the weights lack tensors the model needs \(1\), e.g. "
                                          r"model.layers.0.mlp.down_proj.weight"):
        _load(path)


def test_a_new_user_pointing_model_path_at_a_directory_without_tokenizer_gets_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    out = subprocess.run([sys.executable, "scripts/train.py", "model=hf", f"model.path={tmp_path}", "logger=none"],
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2
    # the composed config's notes (model_task=hf_arithmetic sets algo.lr ...) come first; the error is one line
    lines = [line for line in out.stderr.strip().splitlines() if not line.startswith("INFO ")]
    assert len(lines) == 1 and str(tmp_path) in lines[0] and "has no tokenizer" in lines[0], out.stderr[-2000:]


# ------------------------------------------------------------------------------------------ environments
class WrongTypesEnv:
    """Answers its first action with what `answer` names: the kinds of mistakes environment code makes."""

    def __init__(self, answer: str = "int_observation"):
        self.answer = answer

    def reset(self, prompt):
        if self.answer == "string_reset":
            return "2*3="
        return list(prompt.messages)

    def step(self, action):
        return {
            "int_observation": lambda: StepResult(42),
            "dict": lambda: {"observation": "x", "reward": 1.0, "done": False},
            "tuple": lambda: ("x", 1.0, True, {}),
            "nan_reward": lambda: StepResult("x", reward=float("nan")),
            "string_reward": lambda: StepResult("x", reward="1"),
            "list_info": lambda: StepResult("x", info=[1]),
            "unencodable_observation": lambda: StepResult("résultat"),
        }[self.answer]()


@pytest.mark.parametrize("answer, reason", [
    ("int_observation", "step returned a int observation, expected a str"),
    ("dict", "step returned dict, expected a StepResult"),
    ("tuple", "step returned tuple, expected a StepResult"),
    ("nan_reward", "step returned reward nan, expected a finite number"),
    ("string_reward", "step returned reward '1', expected a finite number"),
    ("list_info", "step returned info of type list, expected a dict"),
    ("unencodable_observation", "step: observation: the chat template cannot encode"),
    ("string_reset", "reset: TypeError: reset returned str, expected a list"),
])
def test_an_environment_answering_with_wrong_types_fails_its_episode_counted(tokenizer, tiny_model, answer, reason):
    engine = LocalEngine(tiny_model)
    try:
        loop = AgentLoop(engine, tokenizer, lambda: WrongTypesEnv(answer),
                         lambda ctx: SamplingParams(temperature=0.0, max_new_tokens=3), max_turns=3)
        (ep,) = loop.run([_prompt("2*3=")])
        assert ep.status is Status.FAILED and reason in ep.error
        cfg = RolloutConfig(rollout_batch_size=1, n_samples_per_prompt=2, max_new_tokens=3)
        dm = RolloutDataModule(engine, tokenizer, ListSource([_prompt("2*3=")]), None, cfg,
                               agent=AgentOptions(env_factory=lambda: WrongTypesEnv(answer), max_turns=3))
        counts = Counter()
        samples = dm.rollout(dm.draw_prompts(1), 2, counts)
        assert counts["env_failed"] == 2 and all(reason in s.metadata["env_error"] for s in samples)
    finally:
        engine.close()
