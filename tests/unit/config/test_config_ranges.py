"""Value ranges: every numeric key of the schema (and of every registered algorithm's schema) declares
the values it may take, and a value outside them stops the run at start-up with one line naming the key,
the value and the range."""

import math
import subprocess
import sys
import time
import typing
from dataclasses import fields, is_dataclass

import pytest

from glmlight.config.ranges import Range, declared_range
from glmlight.config.schema import TrainConfig, validate
from glmlight.errors import ConfigError
from glmlight.config.registry import discover
from tests.conftest import REPO

NUMBER = (int, float)


def _leaf_type(tp):
    """int / float for numeric fields (Optional and list[...] unwrapped), else None."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _leaf_type(args[0]) if len(args) == 1 else None
    if origin is list:
        return _leaf_type(typing.get_args(tp)[0])
    return tp if tp in NUMBER else None


def _walk(cls, prefix=""):
    """(key path, field type, leaf type, range) for every field of `cls` and its nested config dataclasses."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        tp = hints[f.name]
        if is_dataclass(tp):
            yield from _walk(tp, f"{prefix}{f.name}.")
            continue
        leaf = _leaf_type(tp)
        if leaf is not None:
            yield f"{prefix}{f.name}", tp, leaf, declared_range(cls, f.name)


def _schemas():
    out = [("", TrainConfig)]
    for name, spec in sorted(discover().items()):
        out.append((name, spec.schema))
    return out


def _nested(path, value):
    node = value
    for part in reversed(path.split(".")):
        node = {part: node}
    return node


def _outside(rng: Range, leaf):
    if rng.low != -math.inf:
        v = rng.low if rng.low_open else rng.low - 1
    else:
        v = rng.high if rng.high_open else rng.high + 1
    return int(v) if leaf is int else float(v)


CASES = []
for algo, schema in _schemas():
    for key, tp, leaf, rng in _walk(schema, "algo." if algo else ""):
        if algo or not key.startswith("algo."):
            CASES.append(pytest.param(algo, key, tp, leaf, rng, id=f"{algo or 'train'}:{key}"))


@pytest.mark.parametrize("algo, key, tp, leaf, rng", CASES)
def test_every_numeric_key_has_a_range_and_a_value_outside_it_is_one_line(algo, key, tp, leaf, rng):
    assert rng is not None, f"{key} ({tp}) declares no range: add it to the ranges(...) next to its dataclass"
    bad = _outside(rng, leaf)
    is_list = typing.get_origin(tp) is list
    override = _nested(key, [bad] if is_list else bad)
    if algo:
        override["algo"]["name"] = algo
    with pytest.raises(ConfigError) as err:
        validate(override)
    where = f"{key}[0]" if is_list else key
    assert str(err.value) == f"config error: {where} must be {rng}, got {bad!r}"
    assert "\n" not in str(err.value)


def test_the_schema_walk_covers_the_keys_people_set_most():
    keys = {c.values[1] for c in CASES}
    assert {"rollout.temperature", "rollout.top_p", "algo.lr", "algo.eps_low", "algo.betas", "algo.gamma",
            "task.reward_options.timeout_s", "rollout.server.request_retries", "algo.segment_alpha",
            "algo.orm_coef", "model.warm_start.lr", "trainer.max_steps"} <= keys


@pytest.mark.parametrize("spec, inside, outside", [
    ("[0, 1]", [0, 0.5, 1], [-0.1, 1.01, float("nan")]),
    ("(0, 1]", [1e-9, 1], [0, 2]),
    (">= 1", [1, 10**9], [0, float("inf") * -1]),
    ("> 0", [1e-12], [0, -1, float("inf") - float("inf")]),
    ("[0, 4294967295]", [0, 2**32 - 1], [2**32, -1]),
])
def test_range_parsing_and_membership(spec, inside, outside):
    rng = Range.parse(spec)
    assert all(v in rng for v in inside)
    assert not any(v in rng for v in outside)


def test_values_inside_the_ranges_pass():
    cfg = validate({"rollout": {"temperature": 0.0, "top_p": 1.0}, "algo": {"lr": 0.0, "dual_clip_c": 3.0,
                                                                           "loss_agg_constant": None}})
    assert cfg.rollout.temperature == 0.0 and cfg.algo.dual_clip_c == 3.0


def test_a_negative_temperature_stops_the_run_before_any_model_work():
    t0 = time.time()
    out = subprocess.run([sys.executable, "scripts/train.py", "rollout.temperature=-1", "logger=none"], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 2
    # the main job's one INFO line (algo_task=grpo_arithmetic sets trainer.max_steps), then the error alone
    lines = [line for line in out.stderr.strip().splitlines() if not line.startswith("INFO glmlight: ")]
    assert lines == ["config error: rollout.temperature must be >= 0, got -1.0"], out.stderr[-2000:]
    assert "warm start" not in out.stdout.lower() and time.time() - t0 < 120
