"""Value ranges of numeric config keys, declared next to each config dataclass and checked by
`glmlight.config.schema.validate`: a value outside its range stops the run at start-up with one line that
names the key, the value and the range.

    @dataclass
    class MyAlgoConfig(AlgoConfig):
        tau: float = 0.5
        horizon: int = 8

    ranges(MyAlgoConfig, tau="[0, 1]", horizon=">= 1")

(or `tau: float = field(default=0.5, metadata={"range": "[0, 1]"})`). Subclasses inherit their
bases' ranges; a list-valued key is checked element by element; None (an Optional key left unset)
is always allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, is_dataclass

from omegaconf import DictConfig, ListConfig, OmegaConf

from glmlight.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """The values a numeric key may take: an interval, written "[0, 1]", "(0, 1]", "[1, inf)",
    or ">= 0", "> 0", "<= 1", "< 1"."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = True
    high_open: bool = True

    @classmethod
    def parse(cls, spec: "str | Range") -> "Range":
        if isinstance(spec, Range):
            return spec
        text = spec.strip()
        for op, make in ((">=", lambda v: cls(v, math.inf, False, True)), (">", lambda v: cls(v, math.inf, True, True)),
                         ("<=", lambda v: cls(-math.inf, v, True, False)), ("<", lambda v: cls(-math.inf, v, True, True))):
            if text.startswith(op):
                return make(float(text[len(op):]))
        if len(text) < 5 or text[0] not in "[(" or text[-1] not in "])" or "," not in text:
            raise ValueError(f"range {spec!r}: expected an interval like '[0, 1]' or a bound like '>= 0'")
        low, high = (float(x) for x in text[1:-1].split(","))
        return cls(low, high, text[0] == "(", text[-1] == ")")

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        fmt = lambda v: str(int(v)) if float(v).is_integer() else f"{v:g}"  # noqa: E731
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {fmt(self.low)}"
        if self.low == -math.inf:
            return f"{'<' if self.high_open else '<='} {fmt(self.high)}"
        return f"in {'(' if self.low_open else '['}{fmt(self.low)}, {fmt(self.high)}{')' if self.high_open else ']'}"


# Per config dataclass: field name -> Range. Filled by `ranges(...)` right after each dataclass (here and in
# the algorithm modules); a field may instead carry `field(metadata={"range": "[0, 1]"})`. Subclasses
# inherit their bases' ranges. `validate` checks every key that has one.
RANGES: dict[type, dict[str, Range]] = {}
SEED = "[0, 4294967295]"  # what Lightning's seed_everything accepts (outside it picks a random seed)


def ranges(cls: type, **specs: "str | Range") -> None:
    """Declare the allowed values of numeric fields of the config dataclass `cls`."""
    names = {f.name for f in fields(cls)}
    unknown = set(specs) - names
    if unknown:
        raise TypeError(f"ranges({cls.__name__}): no field(s) {sorted(unknown)}")
    RANGES.setdefault(cls, {}).update({k: Range.parse(v) for k, v in specs.items()})


def field_range(cls: type, name: str) -> Range | None:
    """The declared range of `cls.name`: the field's metadata, else the nearest class in the MRO that lists it."""
    for f in fields(cls) if is_dataclass(cls) else ():
        if f.name == name and "range" in f.metadata:
            return Range.parse(f.metadata["range"])
    for klass in getattr(cls, "__mro__", ()):
        if name in RANGES.get(klass, {}):
            return RANGES[klass][name]
    return None


def check_ranges(node: DictConfig, prefix: str = "") -> None:
    """Every key with a declared range (`ranges`, field metadata) holds a value inside it; nested config
    dataclasses are walked. Raises one line: the key, the value and the allowed range."""
    schema = OmegaConf.get_type(node)
    for key in node.keys():
        if OmegaConf.is_missing(node, key):
            continue
        value = node[key]
        path = f"{prefix}{key}"
        if isinstance(value, DictConfig):
            if is_dataclass(OmegaConf.get_type(value)):
                check_ranges(value, f"{path}.")
            continue
        allowed = field_range(schema, str(key)) if is_dataclass(schema) else None
        if allowed is None or value is None:
            continue
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, ListConfig) else [(path, value)]
        for where, v in items:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v not in allowed:
                raise ConfigError(f"config error: {where} must be {allowed}, got {v!r}")
