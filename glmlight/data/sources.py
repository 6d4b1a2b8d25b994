"""Prompt sources: local data files and datasets (JSON Lines, JSON, parquet, directories of them, `save_to_disk`
datasets; reading them: glmlight/data/files.py), synthetic verifiable tasks.

A source is an indexable sequence of `Prompt`s. The data module walks it in a
seeded, reshuffled-every-epoch order and remembers its position (for resume).

A file-backed source is read once, whole, at start-up; a run trains on that snapshot. If the
files change on disk while the run goes on, the run keeps its snapshot and says so
once per change (`FileSource.changes_seen` counts them). Its `fingerprint` (sha256
and prompt count) goes into every checkpoint, and resuming from a checkpoint taken on
other contents stops with one line: the saved position would point at other prompts.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any, Sequence

from glmlight.split import Side, question_key
from glmlight.data.files import read_rows, state as files_state
from glmlight.errors import ConfigError, DataError
from glmlight.prompt import Prompt

log = logging.getLogger(__name__)
CHANGE_CHECK_S = 10.0  # how often a file-backed source looks at its file's size and mtime


def _as_messages(prompt: Any, system_prompt: str | None, where: str) -> list[dict[str, str]]:
    """A prompt field as chat messages: a string (one user turn) or a list of {role, content} messages, the
    content a string or a list of text parts ({"type": "text", "text": ...}, as TRL's conversational rows)."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: empty prompt")
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        messages = [{"role": str(m["role"]), "content": _content(m["content"], where)} for m in prompt]
        if not any(m["content"].strip() for m in messages):
            raise DataError(f"{where}: empty prompt (every message's content is empty)")
    else:
        raise DataError(f"{where}: prompt must be a non-empty string or a list of {{role, content}} messages")
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages


def _content(content: Any, where: str) -> str:
    if not isinstance(content, list):
        return "" if content is None else str(content)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise DataError(f"{where}: a message part of type {kind!r}; only text parts are supported")
        texts.append(str(part.get("text") or ""))
    return "\n".join(texts)


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


_MISSING = object()


def field_value(row: dict[str, Any], key: str) -> Any:
    """row[key]; a dotted key reaches into nested objects (`reward_model.ground_truth`) and lists (`prompt.0`).
    A field named with the dots themselves wins. `_MISSING` when the row has no such field."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return _MISSING
    return value


def field_names(row: dict[str, Any], prefix: str = "", limit: int = 40) -> list[str]:
    """The row's fields, nested objects' as dotted keys (what task.*_key may name), sorted."""
    names = []
    for k, v in row.items():
        if isinstance(v, dict) and v:
            names += field_names(v, f"{prefix}{k}.", limit)
        else:
            names.append(f"{prefix}{k}")
    names = sorted(names)
    return names if prefix or len(names) <= limit else names[:limit] + [f"... {len(names) - limit} more"]


class FileSource(ListSource):
    """The rows of a local file or directory (glmlight/data/files.py: JSON Lines, a JSON array, parquet, a
    directory of them, a `save_to_disk` dataset), each a Prompt.

    `prompt_key`, `label_key` and `domain_key` name the fields (dotted keys reach nested ones: verl's
    `reward_model.ground_truth`). The prompt is a string or a list of {role, content} messages (TRL's
    conversational rows, verl's `prompt`). The metadata holds every other field of the row, the label's and
    domain's included, under their own names (verl's `data_source`, `ability`, `extra_info`): a reward reads
    them from `sample.metadata`. A prompt or label field that no row has stops with one line naming it, the
    fields there are and the key that sets it; `label_key=None` says that the rows carry no label (for a reward
    that reads none). A domain field is optional unless `domain_key` is set to another name than `domain`.

    The rows are read once, whole, at start-up: the run trains on that snapshot, and says once per change when
    the files change on disk (`changes_seen`). Its `fingerprint` (path, sha256, prompt count) goes into every
    checkpoint.
    """

    def __init__(self, path: str, prompt_key: str = "prompt", label_key: str | None = "label",
                 domain_key: str = "domain", system_prompt: str | None = None, format: str = "auto",
                 split: str = "train"):
        self.path, self.format, self.split = path, format, split
        read = read_rows(path, format, split)
        if not read.rows:
            raise DataError(f"prompt file {path} holds no prompts")
        rows = read.rows
        _check_field(path, rows, prompt_key, "task.prompt_key")
        messages = [_as_messages(field_value(row, prompt_key), system_prompt, where) for where, row in rows]
        if label_key is not None:
            _check_field(path, rows, label_key, "task.label_key", label=True)
        if domain_key != "domain":
            _check_field(path, rows, domain_key, "task.domain_key")
        prompts = []
        for (where, row), msgs in zip(rows, messages):
            domain = field_value(row, domain_key)
            prompts.append(Prompt(messages=msgs, label=None if label_key is None else field_value(row, label_key),
                                  domain=str(domain) if domain not in (_MISSING, None, "") else "default",
                                  metadata={k: v for k, v in row.items() if k != prompt_key},
                                  original=field_value(row, prompt_key)))
        super().__init__(prompts)
        self._state = read.state
        self.fingerprint = {"path": path, "sha256": read.sha256, "prompts": len(prompts)}
        self.changes_seen = 0
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    def __getitem__(self, index: int) -> Prompt:
        self.check_file()
        return self.prompts[index]

    def check_file(self, force: bool = False) -> bool:
        """Whether the files on disk still are what was read (sizes, mtimes, which files); a change is logged once."""
        now = time.monotonic()
        if not force and now - self._checked < CHANGE_CHECK_S:
            return True
        with self._lock:
            self._checked = now
            current = files_state(self.path, self.format, self.split)
            if current == self._state:
                return True
            self._state = current
            self.changes_seen += 1
        log.warning("prompt file %s changed on disk while the run reads it; the run keeps the %d prompts it read "
                    "at start-up (sha256 %s...). Restart with a new run to train on the new file",
                    self.path, len(self.prompts), self.fingerprint["sha256"][:12])
        return False




def _check_field(path: str, rows: list[tuple[str, dict[str, Any]]], key: str, setting: str,
                 label: bool = False) -> None:
    """One line when the field `key` is not in every row (or, for the label, is null)."""
    lacking = [(where, row) for where, row in rows if field_value(row, key) is _MISSING]
    if len(lacking) == len(rows):
        hint = f"set {setting}=<field>" + (", or task.label_key=null for a reward that reads no label" if label else "")
        raise ConfigError(f"config error: {path}: no field {key!r} (fields: {', '.join(field_names(rows[0][1]))}); "
                          f"{hint}")
    if lacking:
        where, row = lacking[0]
        raise DataError(f"{where}: no field {key!r} (fields: {', '.join(field_names(row))}; "
                        f"{len(lacking)} of {len(rows)} rows lack it)")
    if label:
        nulls = [where for where, row in rows if field_value(row, key) is None]
        if len(nulls) == len(rows):
            raise ConfigError(f"config error: {path}: field {key!r} is null in every row; set {setting}=<field>, "
                              "or task.label_key=null for a reward that reads no label")
        if nulls:
            raise DataError(f"{nulls[0]}: field {key!r} is null ({len(nulls)} of {len(rows)} rows)")


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
