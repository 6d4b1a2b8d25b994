"""A data set's rows, read from local files as TRL and verl users keep them.

`read_rows(path, format, split)` reads, whole and once:

- `jsonl`: one JSON object per line (`.jsonl`, `.ndjson`);
- `json`: a JSON array of objects (`.json`; JSON Lines under `.json` too, as `datasets`' json loader reads it);
- `parquet`: a parquet file (`.parquet`, `.pq`; needs pyarrow, which `datasets` brings);
- `datasets`: a directory written by `datasets`' `save_to_disk` (a Dataset, or a DatasetDict: `split` picks one);
- a directory of such files, read file by file in name order; when the files' names carry split names as
  `datasets` names them (`train.parquet`, `test.parquet`, `train-00000-of-00002.parquet`, `validation/part-0.jsonl`),
  only those of `split`.

`format="auto"` goes by the name. Paths are local only: a path that does not exist is one line, and the
Hugging Face Hub is never asked. `state(...)` is what change detection compares (every file's size and mtime,
and for a directory which files it holds); `Rows.sha256` identifies the contents (for a single file, the sha256 of
its bytes).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from glmlight.errors import DataError
from glmlight.config.schema import CHOICES

FORMATS = CHOICES["task.format"]  # auto (by the name), jsonl, json, parquet, datasets: the config's one list
EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet"}
DATASETS_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes (DatasetDict, Dataset)
# The split names of `datasets`' data-file patterns (datasets/data_files.py): a file belongs to a split when a
# part of its path, cut at "-._ " and digits, is one of these words.
SPLIT_WORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
               "test": ("test", "testing", "eval", "evaluation")}
PARQUET_MAGIC = b"PAR1"
EXTRA = "pip install 'glmlight[datasets]'"


@dataclass
class Rows:
    """What was read: (where, row) pairs (`where` names the file and line or row), and the contents' identity."""

    rows: list[tuple[str, dict[str, Any]]]
    sha256: str
    state: Any  # state(path, format, split) at the time of reading
    files: list[str] = field(default_factory=list)


def read_rows(path: str, format: str = "auto", split: str = "train") -> Rows:
    """Every row of the local file or directory `path` (see the module docstring)."""
    if format not in FORMATS:
        raise DataError(f"{path}: unknown format {format!r} (one of {', '.join(FORMATS)})")
    if not os.path.exists(path):
        raise DataError(f"{path} does not exist (data is read from local paths only, never from the Hub)")
    if os.path.isdir(path):
        if format == "datasets" or (format == "auto" and _is_saved_dataset(path)):
            return _read_saved_dataset(path, split)
        files = data_files(path, format, split)
        rows, digests, stats = [], [], []
        for f in files:
            data, stat = read_stable(f)
            rows += _parse(f, data, _format_of(f, format))
            rel = os.path.relpath(f, path)
            digests.append(f"{rel}\0{hashlib.sha256(data).hexdigest()}")
            stats.append((rel, *stat) if stat else (rel,))
        return Rows(rows, hashlib.sha256("\n".join(digests).encode()).hexdigest(), tuple(stats), files)
    if format == "datasets":
        raise DataError(f"{path}: task.format=datasets reads a directory written by save_to_disk; this is a file")
    data, stat = read_stable(path)
    return Rows(_parse(path, data, _format_of(path, format)), hashlib.sha256(data).hexdigest(), stat, [path])


def state(path: str, format: str = "auto", split: str = "train") -> Any:
    """What the files under `path` look like now, comparable with `Rows.state` (None where they are gone)."""
    try:
        if not os.path.isdir(path):
            return file_stat(path)
        if format == "datasets" or (format == "auto" and _is_saved_dataset(path)):
            files = sorted(_walk(path))
        else:
            files = data_files(path, format, split)
        stats = []
        for f in files:
            stat = file_stat(f)
            stats.append((os.path.relpath(f, path), *stat) if stat else (os.path.relpath(f, path),))
        return tuple(stats)
    except DataError:
        return None


def data_files(path: str, format: str, split: str) -> list[str]:
    """The data files of directory `path` that `split` reads, in name order."""
    exts = [e for e, f in EXTENSIONS.items() if format in ("auto", f)]
    found = sorted(f for f in _walk(path) if os.path.splitext(f)[1].lower() in exts)
    if not found:
        names = ", ".join(e for e in (".jsonl", ".json", ".parquet") if e in exts)
        raise DataError(f"{path}: no data files ({names}) in the directory")
    named = {f: _splits_named(os.path.relpath(f, path)) for f in found}
    if not any(named.values()):
        return found  # no split names: every file is the one split
    words = set(SPLIT_WORDS.get(split, ())) | {split}
    mine = [f for f in found if words & named[f]["words"]]
    if not mine:
        splits = sorted({s for n in named.values() for s in n["splits"]})
        raise DataError(f"{path}: no files of split {split!r} (the files name the splits: {', '.join(splits)}); "
                        "set task.split")
    return mine


def _splits_named(rel: str) -> dict[str, set[str]]:
    parts = os.path.splitext(rel)[0].replace(os.sep, "/").split("/")
    tokens = {t.lower() for p in parts for t in re.split(r"[-._ 0-9]+", p) if t}
    splits = {s for s, ws in SPLIT_WORDS.items() if tokens & set(ws)}
    return {"splits": splits, "words": tokens} if splits else {}


def _walk(path: str) -> list[str]:
    out = []
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
        out += [os.path.join(root, n) for n in names if not n.startswith((".", "_"))]
    return out


def _format_of(path: str, format: str) -> str:
    if format != "auto":
        return format
    ext = os.path.splitext(path)[1].lower()
    if ext not in EXTENSIONS:
        raise DataError(f"{path}: cannot tell the format from the name; name it .jsonl, .json or .parquet, or set "
                        "task.format=jsonl|json|parquet")
    return EXTENSIONS[ext]


def _parse(path: str, data: bytes, format: str) -> list[tuple[str, dict[str, Any]]]:
    if format == "parquet":
        return _parse_parquet(path, data)
    if data.startswith(PARQUET_MAGIC):
        raise DataError(f"{path} is a parquet file; name it .parquet or set task.format=parquet")
    text = data.decode("utf-8", errors="replace")
    if format == "json":
        try:
            whole = json.loads(text)
        except json.JSONDecodeError as e:
            if e.msg != "Extra data":  # more than one value: JSON Lines
                raise DataError(f"{path}: malformed JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
        else:
            if not isinstance(whole, list):
                what = f"an object with keys {sorted(whole)[:8]}" if isinstance(whole, dict) else type(whole).__name__
                raise DataError(f"{path}: expected a JSON array of rows (or one JSON object per line), got {what}")
            return [_object(f"{path}: row {i}", row) for i, row in enumerate(whole, 1)]
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
        rows.append(_object(where, row))
    return rows


def _object(where: str, row: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return where, row


def _parse_parquet(path: str, data: bytes) -> list[tuple[str, dict[str, Any]]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow: {EXTRA}") from None
    try:
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
    return [(f"{path}: row {i}", row) for i, row in enumerate(table.to_pylist(), 1)]


def _is_saved_dataset(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, m)) for m in DATASETS_MARKERS)


def _read_saved_dataset(path: str, split: str) -> Rows:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: reading a save_to_disk dataset needs the datasets package: {EXTRA}") from None
    files = sorted(_walk(path))
    digests, stats = [], []
    for f in files:
        data, stat = read_stable(f)
        rel = os.path.relpath(f, path)
        digests.append(f"{rel}\0{hashlib.sha256(data).hexdigest()}")
        stats.append((rel, *stat) if stat else (rel,))
    try:
        ds = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError) as e:
        raise DataError(f"{path}: not a dataset written by save_to_disk ({str(e).splitlines()[0]})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{path} has no split {split!r} (splits: {', '.join(sorted(ds))}); set task.split")
        ds = ds[split]
    rows = [(f"{path}[{split}]: row {i}", row) for i, row in enumerate(ds.to_list(), 1)]
    return Rows(rows, hashlib.sha256("\n".join(digests).encode()).hexdigest(), tuple(stats), files)


def file_stat(path: str) -> tuple[int, int] | None:
    """(size, mtime in ns), or None when the file is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def read_stable(path: str, attempts: int = 5) -> tuple[bytes, tuple[int, int] | None]:
    """The file's bytes, read while it did not change (a writer may be rewriting it)."""
    for _ in range(attempts):
        before = file_stat(path)
        with open(path, "rb") as f:
            data = f.read()
        after = file_stat(path)
        if before == after and (after is None or after[0] == len(data)):
            return data, after
        time.sleep(0.2)
    raise DataError(f"prompt file {path} kept changing while it was read ({attempts} attempts); "
                    "wait until it is written completely")

