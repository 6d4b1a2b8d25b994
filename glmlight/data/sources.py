"""Prompt sources: JSONL files, local Hugging Face datasets, synthetic verifiable tasks.

A source is an indexable sequence of `Prompt`s. The data module walks it in a
seeded, reshuffled-every-epoch order and remembers its position (for resume).

A JSONL file is read once, whole, at start-up; a run trains on that snapshot. If the
file changes on disk while the run goes on, the run keeps its snapshot and says so
once per change (`JsonlSource.changes_seen` counts them). Its `fingerprint` (sha256
and prompt count) goes into every checkpoint, and resuming from a checkpoint taken on
other contents stops with one line: the saved position would point at other prompts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import threading
import time
from typing import Any, Sequence

from glmlight.split import Side, question_key
from glmlight.errors import DataError
from glmlight.prompt import Prompt, PromptSource  # noqa: F401  (re-exported: the sources yield Prompts)

log = logging.getLogger(__name__)
CHANGE_CHECK_S = 10.0  # how often a file-backed source looks at its file's size and mtime


def _as_messages(prompt: Any, system_prompt: str | None, where: str) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: empty prompt")
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
        if not any(m["content"].strip() for m in messages):
            raise DataError(f"{where}: empty prompt (every message's content is empty)")
    else:
        raise DataError(f"{where}: prompt must be a non-empty string or a list of {{role, content}} messages")
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages


class ListSource:
    """Prompts held in memory (also the base of the file-backed sources)."""

    def __init__(self, prompts: Sequence[Prompt]):
        if not prompts:
            raise DataError("prompt source is empty")
        self.prompts = list(prompts)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> Prompt:
        return self.prompts[index]


def _row_to_prompt(row: dict[str, Any], where: str, prompt_key: str, label_key: str, domain_key: str,
                    system_prompt: str | None) -> Prompt:
    if prompt_key not in row:
        raise DataError(f"{where}: missing field {prompt_key!r} (fields: {sorted(row)})")
    meta = {k: v for k, v in row.items() if k not in (prompt_key, label_key, domain_key)}
    return Prompt(messages=_as_messages(row[prompt_key], system_prompt, where), label=row.get(label_key),
                  domain=str(row.get(domain_key) or "default"), metadata=meta)


class JsonlSource(ListSource):
    """One JSON object per line with prompt, label and domain fields (names configurable)."""

    def __init__(self, path: str, prompt_key: str = "prompt", label_key: str = "label",
                 domain_key: str = "domain", system_prompt: str | None = None):
        if not os.path.isfile(path):
            raise DataError(f"prompt file {path} does not exist")
        self.path = path
        data, self._stat = _read_stable(path)
        prompts = []
        for lineno, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            prompts.append(_row_to_prompt(row, where, prompt_key, label_key, domain_key, system_prompt))
        if not prompts:
            raise DataError(f"prompt file {path} holds no prompts")
        super().__init__(prompts)
        self.fingerprint = {"path": path, "sha256": hashlib.sha256(data).hexdigest(), "prompts": len(prompts)}
        self.changes_seen = 0
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    def __getitem__(self, index: int) -> Prompt:
        self.check_file()
        return self.prompts[index]

    def check_file(self, force: bool = False) -> bool:
        """Whether the file on disk still is what was read (size, mtime); a change is logged once."""
        now = time.monotonic()
        if not force and now - self._checked < CHANGE_CHECK_S:
            return True
        with self._lock:
            self._checked = now
            stat = _stat(self.path)
            if stat == self._stat:
                return True
            self._stat = stat
            self.changes_seen += 1
        log.warning("prompt file %s changed on disk while the run reads it; the run keeps the %d prompts it read "
                    "at start-up (sha256 %s...). Restart with a new run to train on the new file",
                    self.path, len(self.prompts), self.fingerprint["sha256"][:12])
        return False


def _stat(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def _read_stable(path: str, attempts: int = 5) -> tuple[bytes, tuple[int, int] | None]:
    """The file's bytes, read while it did not change (a writer may be rewriting it)."""
    for _ in range(attempts):
        before = _stat(path)
        with open(path, "rb") as f:
            data = f.read()
        after = _stat(path)
        if before == after and (after is None or after[0] == len(data)):
            return data, after
        time.sleep(0.2)
    raise DataError(f"prompt file {path} kept changing while it was read ({attempts} attempts); "
                    "wait until it is written completely")


class HFDatasetSource(ListSource):
    """A Hugging Face `datasets` dataset from a local path (save_to_disk directory or data files)."""

    def __init__(self, path: str, split: str = "train", prompt_key: str = "prompt", label_key: str = "label",
                 domain_key: str = "domain", system_prompt: str | None = None):
        try:
            import datasets
        except ImportError:
            raise DataError("task.source=hf needs the datasets package: pip install 'glmlight[datasets]'") from None
        if not os.path.exists(path):
            raise DataError(f"dataset path {path} does not exist (datasets are read from local paths only)")
        try:
            ds = datasets.load_from_disk(path)
        except FileNotFoundError:
            ds = datasets.load_dataset(path, split=split)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"dataset {path} has no split {split!r} (splits: {list(ds)})")
            ds = ds[split]
        super().__init__([_row_to_prompt(dict(row), f"{path}[{i}]", prompt_key, label_key, domain_key, system_prompt)
                          for i, row in enumerate(ds)])


class ArithmeticTask:
    """Synthetic verifiable arithmetic: 'a+b=' with the exact answer as label.

    Item i is a pure function of (seed, i), so train and held-out streams are fixed and reproducible.
    A question is a training question or a held-out one, never both (`glmlight.split`): the task
    draws only from its `side` of the split, whatever the seed.
    """

    def __init__(self, max_operand: int = 9, operators: str = "+", seed: int = 0, size: int = 100_000,
                 system_prompt: str | None = None, side: Side = Side()):
        if max_operand < 1 or not operators or set(operators) - set("+-*"):
            raise DataError("arithmetic task needs max_operand >= 1 and operators drawn from '+-*'")
        self.max_operand, self.operators, self.seed, self.size = max_operand, operators, seed, size
        self.system_prompt, self.side = system_prompt, side
        self[0]  # a side of the split with no question stops here, not in the middle of a run

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Prompt:
        rng = random.Random(self.seed * 1_000_003 + index)
        question, answer = self.side.draw(self._draw, lambda item: item[0], rng, "arithmetic")
        return Prompt(messages=_as_messages(question, self.system_prompt, "arithmetic"), label=str(answer),
                      domain="math", metadata={"question": question})

    def _draw(self, rng: random.Random) -> tuple[str, int]:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice(self.operators)
        return f"{a}{op}{b}=", {"+": a + b, "-": a - b, "*": a * b}[op]

    def contains(self, prompt: Prompt) -> bool:
        """Whether `prompt`'s question can occur in this stream (it is on this task's side of the split)."""
        return self.side.holds(question_key(prompt))
