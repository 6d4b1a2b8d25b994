"""Defaults that fit the model: every model x task combination composes; a real model (model=hf, model=smollm2)
gets the sampling length and learning rate of conf/model_task/<model>_<task>.yaml over the tiny model's that the
algorithm files choose, and no forced dtype; the tiny model's task=jsonl warm start teaches answers that task's
reward accepts, within its sampling length."""

import json
import subprocess
import sys

import pytest

from glmlight.config.compose import compose
from glmlight.config.schema import validate
from tests.conftest import REPO

MODELS = ("tiny", "hf", "smollm2")
TASKS = ("arithmetic", "subtraction", "jsonl", "chat_arithmetic", "chat_count_letter", "chat_reverse", "chat_sort",
         "calculator_agent", "running_sum", "gateway_agent")
ALGOS = ("grpo", "sao", "opd", "compaction")
CHAT = ("chat_arithmetic", "chat_count_letter", "chat_reverse", "chat_sort")


def _compose(model, task, *extra):
    overrides = [f"model={model}", f"task={task}"]
    overrides += ["model.path=/ckpt"] if model == "hf" else []
    overrides += ["task.path=data/train.jsonl"] if task == "jsonl" else []
    return validate(compose([*overrides, *extra]))


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("model", MODELS)
def test_every_model_task_algo_combination_composes_and_validates(model, task, algo):
    cfg = _compose(model, task, f"algo={algo}")
    assert cfg.rollout.max_new_tokens >= 1


# (model, task) -> (rollout.max_new_tokens, rollout.max_context, algo.lr), whatever the algorithm
REAL = {("hf", "jsonl"): (512, 2048, 1e-6), ("smollm2", "jsonl"): (256, 1024, 2e-5),
        **{("hf", t): (64, 2048, 1e-6) for t in CHAT}, **{("smollm2", t): (32, 2048, 2e-5) for t in CHAT},
        **{(m, t): (6, 2048, lr) for m, lr in (("hf", 1e-6), ("smollm2", 2e-5)) for t in ("arithmetic", "subtraction")}}


@pytest.mark.parametrize("algo", ("grpo", "sao", "opd"))
@pytest.mark.parametrize("model, task", sorted(REAL))
def test_a_real_model_gets_its_own_sampling_length_and_learning_rate(model, task, algo):
    cfg = _compose(model, task, f"algo={algo}")
    assert (cfg.rollout.max_new_tokens, cfg.rollout.max_context, cfg.algo.lr) == REAL[model, task]
    # the algorithm's own sampling choices stay (SAO: one asynchronous sample per prompt)
    assert cfg.rollout.n_samples_per_prompt == (1 if algo == "sao" else 8)
    assert cfg.model.warm_start.steps == 0


def test_the_tiny_models_choices_stay_as_they_were():
    cfg = _compose("tiny", "jsonl")
    assert (cfg.rollout.max_new_tokens, cfg.algo.lr, cfg.model.warm_start.steps) == (24, 2e-4, 60)
    arithmetic = _compose("tiny", "arithmetic")
    assert (arithmetic.rollout.max_new_tokens, arithmetic.algo.lr) == (6, 5e-4)
    assert _compose("tiny", "chat_sort").algo.lr == 2e-4 and _compose("tiny", "chat_sort", "algo=sao").algo.lr == 2e-4
    assert _compose("tiny", "calculator_agent").model.warm_start.steps == 300


def test_a_command_line_override_wins_over_the_model_task_defaults():
    cfg = _compose("smollm2", "jsonl", "rollout.max_new_tokens=128", "algo.lr=5e-6")
    assert (cfg.rollout.max_new_tokens, cfg.algo.lr) == (128, 5e-6)


def test_a_recipe_keeps_its_own_settings():
    cfg = validate(compose(["experiment=smollm2_grpo"]))
    assert (cfg.rollout.max_new_tokens, cfg.algo.lr, cfg.rollout.rollout_batch_size) == (32, 2e-5, 4)


@pytest.mark.parametrize("model", MODELS)
def test_no_dtype_is_forced_on_a_checkpoint(model):
    """model.dtype null: a checkpoint's own (glmlight.models.loading.checkpoint_dtype); SmolLM2's converted
    checkpoint is float32 and says so."""
    assert _compose(model, "jsonl").model.dtype == {"tiny": None, "hf": None, "smollm2": "float32"}[model]


def test_cfg_job_prints_the_real_models_defaults():
    out = subprocess.run([sys.executable, "scripts/train.py", "model=smollm2", "task=jsonl", "task.path=x.jsonl",
                          "--cfg", "job"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "max_new_tokens: 256" in out.stdout and "lr: 2.0e-05" in out.stdout


MATH_LABELS = ["18", "1250", "0.75", "-4", "1,200", "12500.5", "\\frac{1}{2}", "2\\sqrt{2}", "\\$18", "x = 3"]


def test_the_tiny_jsonl_warm_start_teaches_answers_its_reward_accepts_within_its_sampling_length(tmp_path,
                                                                                                   monkeypatch):
    """Every warm-start answer of a math JSONL (numbers and LaTeX labels), decoded, earns 1.0 from the task's
    default reward and fits rollout.max_new_tokens with its <eos>."""
    pytest.importorskip("math_verify")
    import glmlight.run.build as builder
    from glmlight.models.tokenizer import build_char_tokenizer
    from glmlight.models.warm_start import label_examples
    from glmlight.rewards import task_reward
    from glmlight.sample import Sample

    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Problem {i}: what is the answer?", "label": label}) + "\n"
                            for i, label in enumerate(MATH_LABELS)))
    cfg = _compose("tiny", "jsonl", f"task.path={path}")
    tok = build_char_tokenizer()
    source, _ = builder.build_sources(cfg.task, cfg.seed)
    seen = {}
    monkeypatch.setattr(builder, "supervised_warm_start",
                        lambda model, tokenizer, src, ws, identity, examples=None, mix=(): seen.update(examples=examples))
    builder.warm_start(cfg, None, tok, source, None)
    make = seen["examples"] or label_examples(tok)  # supervised_warm_start's own default
    reward = task_reward(cfg.task, source).fn
    for prompt, (ids, mask) in zip([source[i] for i in range(len(source))], make([source[i] for i in range(len(source))])):
        answer = [t for t, m in zip(ids, mask) if m]
        assert answer[-1] == tok.eos_token_id and len(answer) <= cfg.rollout.max_new_tokens, \
            f"label {prompt.label!r}: {len(answer)} answer tokens, rollout.max_new_tokens={cfg.rollout.max_new_tokens}"
        text = tok.decode(answer[:-1])
        sample = Sample(prompt_ids=[1], response_ids=answer, loss_mask=[1] * len(answer),
                        rollout_logprobs=[0.0] * len(answer), versions=[0] * len(answer),
                        metadata={"completion_text": text, "label": prompt.label})
        score = reward(sample)
        assert (score[0] if isinstance(score, tuple) else score) == 1.0, f"label {prompt.label!r}: taught {text!r}, {score}"


def test_an_answer_format_without_the_label_is_one_line():
    from glmlight.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^config error: task.answer_format='answer' must contain \{label\}"):
        _compose("tiny", "jsonl", "task.answer_format=answer")
