"""A reward module beside the user's data, in the directory a run starts from, is importable by name, as with
TRL and verl scripts run from that directory: `python scripts/train.py task.reward._target_=my_rewards.fn`
(scripts/train.py puts scripts/ first on the path, not the working directory)."""

import json
import os
import subprocess
import sys

from tests.conftest import overrides_for_tests

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_reward_module_in_the_working_directory_is_found(tmp_path):
    (tmp_path / "my_rewards.py").write_text(
        "def has_digit(completions, **kwargs):\n"
        "    texts = [c if isinstance(c, str) else c[0]['content'] for c in completions]\n"
        "    return [float(any(ch.isdigit() for ch in t)) for t in texts]\n")
    overrides = [o for o in overrides_for_tests(tmp_path / "run", "trainer.max_steps=1")
                 if not o.startswith("task.reward._target_")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts/train.py"), *overrides,
                          "task.reward._target_=my_rewards.has_digit"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "samples.jsonl")]
    assert rows and all(r["reward"] in (0.0, 1.0) for r in rows)
