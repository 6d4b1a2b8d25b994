"""Value ranges of numeric config keys, declared on each key's dataclass field and checked by
`glmlight.config.schema.validate`: a value outside its range stops the run at start-up with one line that
names the key, the value and the range.

    @dataclass
    class MyAlgoConfig(AlgoConfig):
        tau: float = field_range("[0, 1]", default=0.5)
        horizon: int = field_range(">= 1", default=8)

(`field_range` is `dataclasses.field` with the range in its metadata: `field(default=0.5, metadata={"range":
"[0, 1]"})` is the same). A class whose fields are written plainly may declare them right after it with
`ranges(MyAlgoConfig, tau="[0, 1]")`, which puts the range on those fields' metadata. A field redeclared in a
subclass without a range keeps its base's; a list-valued key is checked element by element; None (an
Optional key left unset) is always allowed.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, Field, dataclass, field, is_dataclass
from types import MappingProxyType
from typing import Any


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


SEED = "[0, 4294967295]"  # what Lightning's seed_everything accepts (outside it picks a random seed)


def field_range(spec: "str | Range", default: Any = MISSING, *, default_factory: Any = MISSING) -> Any:
    """A dataclass field whose value must lie in `spec` (e.g. ">= 1", "(0, 1]")."""
    return field(default=default, default_factory=default_factory, metadata={"range": Range.parse(spec)})


def ranges(cls: type, **specs: "str | Range") -> None:
    """Put ranges on fields of the config dataclass `cls` that it declares itself (for a class whose fields are
    written without `field_range`)."""
    own = cls.__dict__.get("__annotations__", {})
    unknown = [k for k in specs if k not in own or k not in cls.__dataclass_fields__]
    if unknown:
        raise TypeError(f"ranges({cls.__name__}): no field(s) {sorted(unknown)} declared on it")
    for name, spec in specs.items():
        f: Field = cls.__dataclass_fields__[name]
        f.metadata = MappingProxyType({**f.metadata, "range": Range.parse(spec)})


def declared(cls: type, name: str, what: str) -> Any:
    """The `what` ("range", "choices") declared on field `name` of the config dataclass `cls`: its own field's
    metadata, else that of the nearest base class that declares the field with one; None when none does."""
    for klass in getattr(cls, "__mro__", ()):
        f = klass.__dict__.get("__dataclass_fields__", {}).get(name) if is_dataclass(klass) else None
        if f is not None and what in f.metadata and name in klass.__dict__.get("__annotations__", {}):
            return f.metadata[what]
    return None


def declared_range(cls: type, name: str) -> Range | None:
    """The declared range of `cls.name` (see `declared`)."""
    spec = declared(cls, name, "range")
    return None if spec is None else Range.parse(spec)
