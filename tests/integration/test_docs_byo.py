"""docs/configuration.md's bring-your-own data, reward and model examples stay true.

Every bash block the doc marks `<!-- byo-example -->` runs, line by line, in a directory holding a copy of
examples/ (the documented relative paths, verbatim): a `python scripts/train.py` line through glmlight.run.train.main,
the CLI's own code, with the test-size overrides for one RL step (a `model.path` that does not exist becomes a tiny
Qwen3 checkpoint), any other line in bash. Each run exits 0, and its samples.jsonl shows every trained sample's label
and reward; a run with a held-out file logs eval/heldout/overlap 0. A block marked `compose-only` (it downloads) is
composed and validated. Every `$ python scripts/train.py ...` line the doc shows is followed by the line train.py
prints; the reward code the doc shows is examples/byo/rewards.py's; the model-defaults table is what composing gives.
"""

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from glmlight.config.compose import compose
from glmlight.config.schema import validate
from glmlight.run.train import main
from tests.conftest import overrides_for_tests

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "configuration.md")
TRAIN = "python scripts/train.py"
ENV = re.compile(r"^((?:[A-Z_]+=\S+ )*)(.*)$")


def doc() -> str:
    with open(DOC) as f:
        return f.read()


def blocks() -> list[tuple[str, str, list[str]]]:
    """(an id, the marker's words, the block's command lines) for each marked block, in the doc's order."""
    out = []
    for i, (marker, body) in enumerate(re.findall(r"<!-- byo-example(.*?)-->\n```bash\n(.*?)```", doc(), re.S)):
        lines = [line for line in body.splitlines() if line.strip() and not line.startswith("#")]
        out.append((f"{i}-{_name(lines)}", marker.strip(), lines))
    return out


def _name(lines: list[str]) -> str:
    keys = dict(o.split("=", 1) for o in shlex.split(ENV.match(lines[-1]).group(2)) if "=" in o)
    if "task.reward._target_" in keys:
        return keys["task.reward._target_"].rsplit(".", 1)[-1]
    return f"model={keys['model']}" if "model" in keys else os.path.basename(keys.get("task.path", "?"))


BLOCKS = blocks()


def test_the_doc_shows_each_way_in():
    text = " ".join(line for _, _, lines in BLOCKS for line in lines)
    for shown in ("task.prompt_key=question task.label_key=answer", "task.label_key=reward_model.ground_truth",
                  "task.label_key=solution", "examples/byo/trl_conversational.jsonl", ".parquet", "data/gsm8k_saved",
                  "task.eval_path=", "task.reward._target_=examples.byo.rewards.accuracy_reward",
                  "task.reward._target_=examples.byo.rewards.compute_score", "task.reward._target_=trl.rewards.",
                  "model=hf model.path=", "model.dtype=bfloat16", "model=smollm2", "task.answer_format="):
        assert shown in text, shown
    sections = [doc().index(f"## Bring your own {s}") for s in ("data", "reward", "model")]
    assert sections == sorted(sections) and sections[-1] < doc().index("## Config reference")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny Qwen3 checkpoint, built when a documented `model.path` is first asked for."""
    built = []

    def get() -> str:
        if not built:
            from tests.support.hf_models import build_tiny_hf

            built.append(build_tiny_hf("qwen3", str(tmp_path_factory.mktemp("ckpt"))))
        return built[0]

    return get


@pytest.fixture()
def workdir(tmp_path, monkeypatch):
    """A directory where the documented paths exist as in the repository: a copy of examples/."""
    shutil.copytree(os.path.join(ROOT, "examples", "byo"), tmp_path / "examples" / "byo")
    monkeypatch.chdir(tmp_path)
    for name in [m for m in sys.modules if m == "examples" or m.startswith("examples.")]:
        monkeypatch.delitem(sys.modules, name)
    handlers = list(logging.getLogger("glmlight").handlers)
    yield tmp_path
    logging.getLogger("glmlight").handlers[:] = handlers  # train.main adds one per call


def bash(line: str, cwd) -> None:
    env = {**os.environ, "HF_DATASETS_CACHE": str(cwd / ".hf"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(line, shell=True, executable="/bin/bash", cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (line, proc.stderr[-2000:])


def train(line: str, cwd, run_dir, checkpoint, monkeypatch) -> list[str]:
    env, command = ENV.match(line).groups()
    for assignment in env.split():
        key, value = assignment.split("=", 1)
        if key == "PYTHONPATH":
            monkeypatch.syspath_prepend(str(cwd / value))
        else:
            monkeypatch.setenv(key, value)
    overrides = shlex.split(command)[2:]
    overrides = [f"model.path={checkpoint()}" if o.startswith("model.path=") and not os.path.exists(o[11:]) else o
                 for o in overrides]
    test = [o for o in overrides_for_tests(run_dir) if not o.startswith("task.reward._target_=")]
    return [*test, *overrides, "trainer.max_steps=1", "eval.k=2"]


@pytest.mark.parametrize("block", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_a_documented_example_runs_and_computes_rewards(block, workdir, tiny_checkpoint, monkeypatch):
    _, marker, lines = block
    compose_only = marker.startswith("compose-only")
    for k, line in enumerate(lines):
        if line.startswith("pip "):
            continue
        if not ENV.match(line).group(2).startswith(TRAIN + " "):
            bash(line, workdir)
            continue
        run_dir = workdir / "runs" / str(k)
        overrides = train(line, workdir, run_dir, tiny_checkpoint, monkeypatch)
        if compose_only:
            validate(compose(overrides))
            continue
        assert main(overrides) == 0, line
        rows = [json.loads(r) for r in (run_dir / "samples.jsonl").read_text().splitlines()]
        trained = [r for r in rows if r["drop_reason"] is None]
        assert trained and all(r["label"] is not None and isinstance(r["reward"], float) for r in trained), rows[:2]
        for r in trained:  # what the reward saw: MathVerify's gold answer is the label, verl's data_source the row's
            assert r["reward_info"].get("gold", str(r["label"])) == str(r["label"]), r
            assert r["reward_info"].get("data_source", "openai/gsm8k") == "openai/gsm8k", r
        metrics = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert not any(m.get("rollout/reward_failed") for m in metrics), line
        if "task.eval_path=" in line:
            assert [m["eval/heldout/overlap"] for m in metrics if "eval/heldout/overlap" in m][:1] == [0.0]


ERRORS = re.findall(r"^\$ python scripts/train\.py (.*)\n(config error: .*)$", doc(), re.M)


@pytest.mark.parametrize("overrides, line", ERRORS, ids=[o for o, _ in ERRORS])
def test_a_documented_error_is_the_line_train_py_prints(overrides, line, workdir, capsys):
    quick = ["model.preset=test", "model.warm_start.steps=0", "logger=none", f"trainer.default_root_dir={workdir}/r"]
    assert main([*shlex.split(overrides), *quick]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == line and "Traceback" not in err


def test_the_reward_code_the_doc_shows_is_the_example_modules():
    section = doc().split("## Bring your own reward", 1)[1].split("\n## ", 1)[0]
    shown = re.findall(r"```python\n(.*?)```", section, re.S)
    with open(os.path.join(ROOT, "examples", "byo", "rewards.py")) as f:
        module = f.read()
    assert len(shown) == 3 and all(code in module for code in shown)


# | `model` | tasks | max_new_tokens (note) | max_context | lr (note) | warm start |
ROW = r"^\| `(tiny|hf|smollm2)` \| (.*?) \| (\d+)[^|]* \| (\d+) \| ([\d.e-]+)[^|]* \| (none|\d+ steps)[^|]* \|$"
DEFAULTS = re.findall(ROW, doc(), re.M)
CHAT = ["chat_arithmetic", "chat_count_letter", "chat_reverse", "chat_sort"]


def test_the_model_defaults_table_has_every_row():
    assert [r[0] for r in DEFAULTS] == ["tiny"] * 2 + ["hf"] * 3 + ["smollm2"] * 3


@pytest.mark.parametrize("model, tasks, max_new_tokens, max_context, lr, warm", DEFAULTS,
                         ids=[f"{r[0]}-{r[1][:20]}" for r in DEFAULTS])
def test_the_model_defaults_table_is_what_composing_gives(model, tasks, max_new_tokens, max_context, lr, warm):
    names = CHAT if "chat_*" in tasks else re.findall(r"`(\w+)`", tasks)
    steps = 0 if warm == "none" else int(warm.split()[0])
    for task in names:
        extra = (["model.path=/ckpt"] if model == "hf" else []) + (["task.path=x.jsonl"] if task == "jsonl" else [])
        cfg = validate(compose([f"model={model}", f"task={task}", *extra]))
        got = (cfg.rollout.max_new_tokens, cfg.rollout.max_context, cfg.algo.lr, cfg.model.warm_start.steps)
        assert got == (int(max_new_tokens), int(max_context), float(lr), steps), (model, task)
