"""Prompt files as TRL and verl users have them (glmlight/data/files.py, FileSource): JSON Lines, a JSON
array, parquet, directories of shards, `save_to_disk` datasets; dotted keys, conversational prompts, and
the one-line errors of a field that is not there. Every file is written here, in tmp_path."""

import hashlib
import json
import time

import pytest

from glmlight.data.sources import FileSource
from glmlight.errors import ConfigError, DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

QUESTIONS = [("Tom has 3 apples and buys 2 more. How many apples does he have?", "5"),
             ("A box holds 12 eggs. How many eggs are in 6 boxes?", "72"),
             ("Half of a number is 9. What is the number?", "18")]


def verl_rows(split: str = "train") -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": a},
             "extra_info": {"split": split, "index": i, "answer": f"... #### {a}", "question": q}}
            for i, (q, a) in enumerate(QUESTIONS)]


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def gsm_rows():
    return [{"question": q, "answer": a} for q, a in QUESTIONS]


def test_verl_parquet_with_the_nested_ground_truth(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", verl_rows())
    src = FileSource(path, label_key="reward_model.ground_truth")
    assert len(src) == 3 and [p.label for p in src.prompts] == ["5", "72", "18"]
    p = src[1]
    assert p.messages == [{"role": "user", "content": QUESTIONS[1][0]}]
    assert p.metadata["data_source"] == "openai/gsm8k" and p.metadata["ability"] == "math"
    assert p.metadata["extra_info"]["index"] == 1 and p.metadata["reward_model"]["style"] == "rule"
    assert "prompt" not in p.metadata and p.domain == "default"
    assert FileSource(path, label_key="reward_model.ground_truth", domain_key="ability")[0].domain == "math"


def test_json_array_json_lines_and_what_a_json_file_may_hold(tmp_path):
    array = tmp_path / "gsm.json"
    array.write_text(json.dumps(gsm_rows(), indent=1))
    src = FileSource(str(array), prompt_key="question", label_key="answer")
    assert [p.label for p in src.prompts] == ["5", "72", "18"] and src[0].metadata == {"answer": "5"}
    lines = tmp_path / "lines.json"  # datasets' json loader takes JSON Lines under .json too
    write_jsonl(lines, gsm_rows())
    assert len(FileSource(str(lines), prompt_key="question", label_key="answer")) == 3
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"data": gsm_rows()}))
    with pytest.raises(DataError, match=r"wrapped.json: expected a JSON array of rows .*got an object with keys "
                                        r"\['data'\]"):
        FileSource(str(wrapped), prompt_key="question", label_key="answer")
    scalars = tmp_path / "scalars.json"
    scalars.write_text("[1, 2]")
    with pytest.raises(DataError, match=r"scalars.json: row 1: expected a JSON object, got int"):
        FileSource(str(scalars))


def test_trl_conversational_and_standard_prompts(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "Think, then answer."}, {"role": "user", "content": q}],
             "solution": a} for q, a in QUESTIONS]
    conv = FileSource(write_parquet(tmp_path / "conv.parquet", rows), label_key="solution")
    assert conv[0].messages[0] == {"role": "system", "content": "Think, then answer."}
    assert conv[0].messages[1]["content"] == QUESTIONS[0][0] and conv[0].label == "5"
    assert conv[0].metadata == {"solution": "5"}  # every column but the prompt: a reward may read any of them
    parts = [{"prompt": [{"role": "user", "content": [{"type": "text", "text": q}]}], "solution": a}
             for q, a in QUESTIONS]
    assert FileSource(write_jsonl(tmp_path / "parts.jsonl", parts), label_key="solution")[2].messages == [
        {"role": "user", "content": QUESTIONS[2][0]}]
    image = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}],
              "solution": "cat"}]
    with pytest.raises(DataError, match=r"image.jsonl:1: .*'image'.*text"):
        FileSource(write_jsonl(tmp_path / "image.jsonl", image), label_key="solution")
    standard = FileSource(write_jsonl(tmp_path / "std.jsonl", [{"prompt": q, "solution": a} for q, a in QUESTIONS]),
                          label_key="solution", system_prompt="be brief")
    assert standard[0].messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": QUESTIONS[0][0]}]


def test_a_missing_field_stops_with_one_line_naming_it_the_fields_and_the_key(tmp_path):
    gsm = write_jsonl(tmp_path / "gsm.jsonl", gsm_rows())
    with pytest.raises(ConfigError) as err:
        FileSource(gsm)
    assert str(err.value) == (f"config error: {gsm}: no field 'prompt' (fields: answer, question); "
                              "set task.prompt_key=<field>")
    with pytest.raises(ConfigError) as err:
        FileSource(gsm, prompt_key="question")
    assert str(err.value) == (f"config error: {gsm}: no field 'label' (fields: answer, question); "
                              "set task.label_key=<field>, or task.label_key=null for a reward that reads no label")
    verl = write_parquet(tmp_path / "verl.parquet", verl_rows())
    with pytest.raises(ConfigError) as err:
        FileSource(verl)
    assert str(err.value) == (
        f"config error: {verl}: no field 'label' (fields: ability, data_source, extra_info.answer, extra_info.index, "
        "extra_info.question, extra_info.split, prompt, reward_model.ground_truth, reward_model.style); "
        "set task.label_key=<field>, or task.label_key=null for a reward that reads no label")
    with pytest.raises(ConfigError, match=r"no field 'reward_model.truth' .*set task.label_key=<field>"):
        FileSource(verl, label_key="reward_model.truth")
    with pytest.raises(ConfigError, match=r"no field 'kind' .*set task.domain_key=<field>"):  # a domain key that is set
        FileSource(verl, label_key="reward_model.ground_truth", domain_key="kind")
    assert FileSource(verl, label_key="reward_model.ground_truth", domain_key="domain")[0].domain == "default"
    ds = tmp_path / "ds"
    pytest.importorskip("datasets").Dataset.from_list(gsm_rows()).save_to_disk(str(ds))
    with pytest.raises(ConfigError, match=r"ds: no field 'prompt' \(fields: answer, question\); set task.prompt_key"):
        FileSource(str(ds))
    for msg in ("missing field", "malformed JSON"):
        assert msg not in str(err.value)


def test_rows_that_lack_a_field_or_carry_a_null_label_are_named(tmp_path):
    rows = gsm_rows()
    del rows[1]["answer"]
    some = write_jsonl(tmp_path / "some.jsonl", rows)
    with pytest.raises(DataError) as err:
        FileSource(some, prompt_key="question", label_key="answer")
    assert str(err.value) == f"{some}:2: no field 'answer' (fields: question; 1 of 3 rows lack it)"
    nulls = write_parquet(tmp_path / "nulls.parquet", [{"question": q, "answer": None} for q, _ in QUESTIONS])
    with pytest.raises(ConfigError, match=r"nulls.parquet: field 'answer' is null in every row; set task.label_key"):
        FileSource(nulls, prompt_key="question", label_key="answer")
    one_null = write_parquet(tmp_path / "one_null.parquet", [{"question": "q?", "answer": "1"},
                                                            {"question": "r?", "answer": None}])
    with pytest.raises(DataError, match=r"one_null.parquet: row 2: field 'answer' is null"):
        FileSource(one_null, prompt_key="question", label_key="answer")
    unlabeled = FileSource(write_jsonl(tmp_path / "u.jsonl", [{"prompt": q} for q, _ in QUESTIONS]), label_key=None)
    assert [p.label for p in unlabeled.prompts] == [None] * 3  # said outright: task.label_key=null


def test_save_to_disk_datasets_and_their_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    one = tmp_path / "one"
    datasets.Dataset.from_list(verl_rows()).save_to_disk(str(one))
    src = FileSource(str(one), label_key="reward_model.ground_truth")
    assert [p.label for p in src.prompts] == ["5", "72", "18"] and src[0].metadata["extra_info"]["split"] == "train"
    both = tmp_path / "both"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(gsm_rows()),
                          "test": datasets.Dataset.from_list(gsm_rows()[:1])}).save_to_disk(str(both))
    keys = dict(prompt_key="question", label_key="answer")
    assert len(FileSource(str(both), **keys)) == 3 and len(FileSource(str(both), split="test", **keys)) == 1
    with pytest.raises(DataError, match=r"both has no split 'dev' \(splits: test, train\); set task.split"):
        FileSource(str(both), split="dev", **keys)
    before = FileSource(str(one), label_key="reward_model.ground_truth").fingerprint
    datasets.Dataset.from_list(verl_rows()[:2]).save_to_disk(str(tmp_path / "two"))
    assert FileSource(str(tmp_path / "two"), label_key="reward_model.ground_truth").fingerprint["sha256"] != before["sha256"]


def test_directories_of_shards_and_of_named_splits(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    rows = verl_rows()
    write_parquet(shards / "part-00001.parquet", rows[2:])
    write_parquet(shards / "part-00000.parquet", rows[:2])
    (shards / "README.md").write_text("not data")
    (shards / ".hidden.parquet").write_text("not data either")
    src = FileSource(str(shards), label_key="reward_model.ground_truth")
    assert [p.label for p in src.prompts] == ["5", "72", "18"]  # file by file, in name order
    verl = tmp_path / "gsm8k"  # verl's data_preprocess output: train.parquet and test.parquet side by side
    verl.mkdir()
    write_parquet(verl / "train.parquet", verl_rows("train"))
    write_parquet(verl / "test.parquet", verl_rows("test")[:1])
    keys = dict(label_key="reward_model.ground_truth")
    assert len(FileSource(str(verl), **keys)) == 3 and len(FileSource(str(verl), split="test", **keys)) == 1
    hub = tmp_path / "hub" / "main"  # a Hub dataset's files, downloaded: main/train-00000-of-00001.parquet
    hub.mkdir(parents=True)
    write_jsonl(hub / "train-00000-of-00001.jsonl", gsm_rows())
    write_jsonl(hub / "validation-00000-of-00001.jsonl", gsm_rows()[:2])
    gkeys = dict(prompt_key="question", label_key="answer")
    assert len(FileSource(str(hub), **gkeys)) == 3 and len(FileSource(str(hub), split="validation", **gkeys)) == 2
    with pytest.raises(DataError, match=r"main: no files of split 'test' \(the files name the splits: train, "
                                        r"validation\); set task.split"):
        FileSource(str(hub), split="test", **gkeys)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=r"empty: no data files \(\.jsonl, \.json, \.parquet\)"):
        FileSource(str(empty))


def test_format_by_name_or_task_format_and_local_paths_only(tmp_path):
    path = write_parquet(tmp_path / "train.data", verl_rows())
    with pytest.raises(DataError, match=r"train.data: cannot tell the format from the name; .*task.format"):
        FileSource(path)
    assert len(FileSource(path, format="parquet", label_key="reward_model.ground_truth")) == 3
    misnamed = write_parquet(tmp_path / "train.jsonl", verl_rows())
    with pytest.raises(DataError, match=r"train.jsonl is a parquet file.*task.format=parquet"):
        FileSource(misnamed, label_key="reward_model.ground_truth")
    with pytest.raises(DataError, match=r"train.jsonl is a parquet file"):
        FileSource(misnamed, format="json", label_key="reward_model.ground_truth")
    t0 = time.monotonic()
    for missing in ("data/verl_train.parquet", "openai/gsm8k"):
        with pytest.raises(DataError) as err:
            FileSource(missing)
        assert str(err.value) == f"{missing} does not exist (data is read from local paths only, never from the Hub)"
    assert time.monotonic() - t0 < 1.0  # no retries


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "train.parquet", verl_rows())
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)
    with pytest.raises(DataError) as err:
        FileSource(path, label_key="reward_model.ground_truth")
    assert str(err.value) == f"{path}: reading parquet needs pyarrow: pip install 'glmlight[datasets]'"


def test_every_format_keeps_its_snapshot_sees_changes_and_has_a_fingerprint(tmp_path, caplog):
    jsonl = write_jsonl(tmp_path / "p.jsonl", gsm_rows())
    src = FileSource(jsonl, prompt_key="question", label_key="answer")
    data = open(jsonl, "rb").read()  # the sha256 of a one-file source is its bytes' (checkpoints stay valid)
    assert src.fingerprint == {"path": jsonl, "sha256": hashlib.sha256(data).hexdigest(), "prompts": 3}
    shards = tmp_path / "shards"
    shards.mkdir()
    write_parquet(shards / "a.parquet", verl_rows()[:2])
    keys = dict(label_key="reward_model.ground_truth")
    for path in (write_parquet(tmp_path / "t.parquet", verl_rows()), str(shards)):
        src = FileSource(path, **keys)
        assert src.check_file(force=True) and src.changes_seen == 0
        time.sleep(0.01)
        target = path if path.endswith(".parquet") else str(shards / "b.parquet")  # a new shard is a change too
        write_parquet(target, verl_rows()[:1])
        assert not src.check_file(force=True) and src.changes_seen == 1
        assert src.check_file(force=True) and src.changes_seen == 1  # said once per change
        assert len(src) == (3 if path.endswith(".parquet") else 2)  # the run keeps what it read
        assert FileSource(path, **keys).fingerprint["sha256"] != src.fingerprint["sha256"]
    assert sum("changed on disk" in r.message for r in caplog.records) == 2


def test_the_task_keys_reach_every_format(tmp_path):
    from glmlight.run.build import build_sources
    from glmlight.config.compose import compose
    from glmlight.config.schema import validate

    path = write_parquet(tmp_path / "verl.parquet", verl_rows())
    for source in ("jsonl", "hf"):  # hf: the same local reader, never the Hub
        cfg = validate(compose(["task=jsonl", f"task.source={source}", f"task.path={path}", f"task.eval_path={path}",
                                "task.label_key=reward_model.ground_truth"]))
        train, heldout = build_sources(cfg.task, 0)
        assert [p.label for p in train.prompts] == ["5", "72", "18"] and len(heldout) == 3
    odd = write_parquet(tmp_path / "verl.data", verl_rows())
    cfg = validate(compose(["task=jsonl", f"task.path={odd}", "task.format=parquet", "task.label_key=null"]))
    assert cfg.task.label_key is None and [p.label for p in build_sources(cfg.task, 0)[0].prompts] == [None] * 3
    from glmlight.data.files import EXTENSIONS, FORMATS
    assert set(FORMATS) == {"auto", "datasets", *EXTENSIONS.values()}  # the config's list is what is read
    with pytest.raises(ConfigError, match=r"config error: task.format='csv' is not one of \['auto', 'jsonl', 'json', "
                                          r"'parquet', 'datasets'\]"):
        validate(compose(["task=jsonl", f"task.path={path}", "task.format=csv"]))


def test_the_warm_start_never_teaches_a_missing_label(tokenizer):
    from glmlight.models.warm_start import label_examples
    from glmlight.prompt import Prompt

    with pytest.raises(ConfigError, match=r"task.label_key=null\): set model.warm_start.steps=0"):
        label_examples(tokenizer)([Prompt(messages=[{"role": "user", "content": "1+1="}])])


def test_a_rows_own_label_field_does_not_shadow_the_configured_label(tmp_path, tokenizer):
    from glmlight.data.rollout_groups import answer_samples

    class Ids:
        def new_group_id(self):
            return 0

        def take_rollout_ids(self, n):
            return 0

    rows = [{"question": "2+2=", "answer": "4", "label": "arithmetic", "domain": "school"}]
    prompt = FileSource(write_jsonl(tmp_path / "p.jsonl", rows), prompt_key="question", label_key="answer",
                        domain_key="domain")[0]
    (sample,) = answer_samples([(prompt, [1, 2])], [None], 1, Ids(), tokenizer)
    assert sample.metadata["label"] == "4" and sample.metadata["answer"] == "4" and sample.metadata["domain"] == "school"
