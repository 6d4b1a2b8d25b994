"""The word problems glmlight ships (glmlight/data/word_problems/, written by scripts/make_word_problems.py) and
the recipe that reads them (experiment=smollm2_math): the files are what the generator writes, every answer is
right, no held-out problem's arithmetic is trained on, and the recipe reads them from the installed package
as a TRL user's JSONL."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

from glmlight.run.build import build_sources
from glmlight.config.compose import compose
from glmlight.config.schema import validate
from glmlight.rewards.mathverify import MathVerify
from glmlight.sample import Sample
from glmlight.split import question_key

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "glmlight/data/word_problems"


def _generator():
    spec = importlib.util.spec_from_file_location("make_word_problems", ROOT / "scripts/make_word_problems.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(name):
    return [json.loads(line) for line in open(DATA / f"{name}.jsonl")]


def test_the_shipped_files_are_what_the_generator_writes(tmp_path):
    gen = _generator()
    train, heldout = gen.build()
    assert _rows("train") == train and _rows("heldout") == heldout
    assert (len(train), len(heldout)) == (400, 100)
    assert _rows("one_step_train") == [r for r in train if r["kind"] in gen.ONE_STEP]
    assert _rows("one_step_heldout") == [r for r in heldout if r["kind"] in gen.ONE_STEP]
    subprocess.run([sys.executable, str(ROOT / "scripts/make_word_problems.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    for f in DATA.glob("*.jsonl"):
        assert (tmp_path / f.name).read_bytes() == f.read_bytes(), f.name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in DATA.glob("*.jsonl"))


def test_every_answer_is_the_arithmetic_of_its_working():
    """Each worked solution's equations hold and end in the label (GSM8K's `#### <number>`)."""
    for row in _rows("train") + _rows("heldout"):
        working, final = row["answer"].split("\n#### ")
        assert final == row["label"]
        for lhs, rhs in re.findall(r"(\d+(?: [-+*/] \d+)+) = (\d+)", working):
            assert eval(lhs) == int(rhs), row  # noqa: S307 - digits and operators only
        assert working.rstrip(".").endswith(f"= {row['label']}"), row


def test_no_held_out_problem_shares_its_template_and_numbers_with_a_training_problem():
    """The question texts differ, and so does the arithmetic: the numbers of a held-out problem never occur, in the
    same template, in training (a renamed copy of a training problem would not be held out)."""
    gen = _generator()

    def arithmetic(row):
        return row["kind"], tuple(int(n) for n in re.findall(r"\d+", row["question"]))

    train, heldout = _rows("train"), _rows("heldout")
    assert not {r["question"] for r in train} & {r["question"] for r in heldout}
    assert not {arithmetic(r) for r in train} & {arithmetic(r) for r in heldout}
    assert {r["kind"] for r in heldout} == set(gen.TEMPLATES)


def test_the_one_step_recipe_reads_its_own_files():
    cfg = validate(compose(["experiment=smollm2_math_one_step"]))
    assert Path(cfg.task.eval_path) == DATA / "one_step_heldout.jsonl" and cfg.task.num_eval_prompts == 49
    train, held = build_sources(cfg.task, 0)
    assert (len(train), len(held)) == (201, 49) and cfg.run_name == "smollm2_math_one_step"
    assert cfg.task.system_prompt == validate(compose(["experiment=smollm2_math"])).task.system_prompt


def test_the_recipe_reads_the_packaged_files_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = validate(compose(["experiment=smollm2_math"]))
    assert Path(cfg.task.path) == DATA / "train.jsonl" and Path(cfg.task.eval_path) == DATA / "heldout.jsonl"
    train, held = build_sources(cfg.task, 0)
    assert len(train) == 400 and len(held) == 100
    trained = {question_key(train[i]) for i in range(len(train))}
    assert not trained & {question_key(held[i]) for i in range(len(held))}
    prompt = held[0]
    assert prompt.messages[0]["role"] == "system" and "\\boxed{}" in prompt.messages[0]["content"]
    assert prompt.label == _rows("heldout")[0]["label"]


def test_math_verify_scores_the_shipped_labels():
    """The recipe's reward reads every label, and a boxed answer or a last number that equals it scores 1."""
    reward = MathVerify()
    for row in _rows("heldout")[:20]:
        for text, want in ((f"So the answer is \\boxed{{{row['label']}}}.", 1.0),
                           (f"{row['answer'].split(chr(10))[0]} The answer is {row['label']}.", 1.0),
                           (f"The answer is \\boxed{{{int(row['label']) + 1}}}.", 0.0)):
            sample = Sample(prompt_ids=[1], response_ids=[2], loss_mask=[1], rollout_logprobs=[0.0], versions=[0], metadata={"completion_text": text, "label": row["label"]})
            assert reward(sample)[0] == want, (row, text)
