"""Allowed values and the walk that checks a config: `choice(...)` declares the values a key may take on its
dataclass field (beside `glmlight.config.ranges.field_range`), each config dataclass may hold its section's
cross-key rules in a `check(self, cfg)` method, and `check_config` walks a merged config once: every key's
range and allowed values, then every section's `check`. (`glmlight.config.schema.CHOICES` reads the allowed values
by dotted key off the schema's fields, for code that acts on a key by its name.)

    @dataclass
    class MySection:
        mode: str = choice("sync", "async", default="sync")
        depth: int = field_range(">= 0", default=0)

        def check(self, cfg):  # self: this section's node of the merged config, cfg: the whole config
            if self.mode == "async" and self.depth:
                raise ConfigError("config error: my.depth needs my.mode=sync")
"""

from __future__ import annotations

from dataclasses import MISSING, field, fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from glmlight.config.ranges import declared, declared_range
from glmlight.errors import ConfigError


def choice(*values: Any, default: Any = MISSING) -> Any:
    """A dataclass field whose value must be one of `values` (None, an Optional key left unset, is allowed)."""
    return field(default=default, metadata={"choices": tuple(values)})


def check_config(cfg: DictConfig) -> None:
    """Raise ConfigError, one line naming the key, for a value outside its range or its allowed values, then for
    a broken cross-key rule (each section's `check`, sections in the schema's order, a section before its own)."""
    _check_values(cfg)
    _check_sections(cfg, cfg)


def _check_values(node: DictConfig, prefix: str = "") -> None:
    schema = OmegaConf.get_type(node)
    for key in node.keys():
        if OmegaConf.is_missing(node, key):
            continue
        value = node[key]
        path = f"{prefix}{key}"
        if isinstance(value, DictConfig):
            if is_dataclass(OmegaConf.get_type(value)):
                _check_values(value, f"{path}.")
            continue
        if value is None or not is_dataclass(schema):
            continue
        _check_value(schema, str(key), value, path)


def _check_value(schema: type, key: str, value: Any, path: str) -> None:
    """`value` of field `key` of the dataclass `schema` against its declared range and allowed values."""
    rng = declared_range(schema, key)
    if rng is not None:
        items = ([(f"{path}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, (ListConfig, list, tuple))
                 else [(path, value)])
        for where, v in items:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v not in rng:
                raise ConfigError(f"config error: {where} must be {rng}, got {v!r}")
    allowed = declared(schema, key, "choices")
    if allowed is not None and value not in allowed:
        raise ConfigError(f"config error: {path}={value!r} is not one of {list(allowed)}")


def check_section(section: Any, prefix: str) -> None:
    """The fields of one config dataclass instance built outside `validate` (the Python API: e.g. RewardOptions
    passed to a reward) against their declared ranges and allowed values, with validate's one-line messages."""
    for f in fields(section):
        value = getattr(section, f.name)
        if value is not None:
            _check_value(type(section), f.name, value, f"{prefix}.{f.name}")


def _check_sections(node: DictConfig, cfg: DictConfig) -> None:
    check = getattr(OmegaConf.get_type(node), "check", None)
    if check is not None:
        check(node, cfg)
    for key in node.keys():
        if OmegaConf.is_missing(node, key):
            continue
        value = node[key]
        if isinstance(value, DictConfig) and is_dataclass(OmegaConf.get_type(value)):
            _check_sections(value, cfg)
