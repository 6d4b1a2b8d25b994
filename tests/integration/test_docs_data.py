"""docs/configuration.md's "Bring your own data" stays true: each documented command runs, as written, on the
row the docs show next to it (written to the documented file, in tmp_path), with the test-size overrides, one RL
step; the documented error line is what `scripts/train.py` prints."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

import glmlight
from glmlight.cli import compose
from tests.conftest import overrides_for_tests

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS = 8


def section() -> str:
    text = open(os.path.join(ROOT, "docs", "configuration.md")).read()
    start = text.index("## Bring your own data")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def examples() -> list[tuple[dict[str, dict], list[str]]]:
    """(file -> the row the docs show for it, the command's overrides) for each documented command."""
    out, rows = [], {}
    for block in re.findall(r"```bash\n(.*?)```", section(), re.S):
        for line in block.splitlines():
            if m := re.match(r"# (\S+): (\{.*\})$", line):
                rows[m.group(1)] = json.loads(m.group(2))
            elif line.startswith("python scripts/train.py "):
                out.append((dict(rows), shlex.split(line)[2:]))
    return out


def write(path: str, row: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    rows = [row] * ROWS
    if path.endswith(".parquet"):
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def test_the_docs_show_a_trl_and_a_verl_layout():
    commands = [" ".join(overrides) for _, overrides in examples()]
    assert any("task.prompt_key=question task.label_key=answer" in c for c in commands)
    assert any("task.label_key=reward_model.ground_truth" in c and ".parquet" in c for c in commands)
    assert any("task.label_key=solution" in c for c in commands)


@pytest.mark.parametrize("index", range(3))
def test_a_documented_command_trains_on_the_documented_layout(tmp_path, monkeypatch, index):
    rows, overrides = examples()[index]
    monkeypatch.chdir(tmp_path)  # the documented relative paths, verbatim
    paths = {k: v for k, v in (o.split("=", 1) for o in overrides) if k in ("task.path", "task.eval_path")}
    shown = rows[paths["task.path"]]
    for path in paths.values():
        write(path, rows.get(path, shown))  # the held-out file: the training file's layout
    run = glmlight.build(compose(overrides_for_tests(tmp_path, *overrides, "trainer.max_steps=1",
                                                     "~callbacks.held_out_eval")))
    keys = dict(o.split("=", 1) for o in overrides)
    label, prompt_key = keys.get("task.label_key", "label"), keys.get("task.prompt_key", "prompt")
    expected = shown
    for part in label.split("."):
        expected = expected[part]
    prompt = run.datamodule.source[0]
    assert prompt.label == expected and prompt.messages[-1]["role"] == "user"
    assert prompt.messages[-1]["content"] in json.dumps(shown, ensure_ascii=False)
    assert {k for k in shown if k != prompt_key} <= set(prompt.metadata)  # the other fields, for the reward
    run.fit()
    assert run.trainer.global_step >= 1


def test_the_documented_error_is_the_line_train_py_prints(tmp_path):
    m = re.search(r"\$ python scripts/train.py (.*)\n(config error: .*)\n", section())
    overrides, line = shlex.split(m.group(1)), m.group(2)
    rows, _ = examples()[0]
    path = dict(o.split("=", 1) for o in overrides)["task.path"]
    write(str(tmp_path / path), rows[path])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train.py"), *overrides, "model.preset=test",
                           "model.warm_start.steps=0", "logger=none", f"trainer.default_root_dir={tmp_path}/run"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == line, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
