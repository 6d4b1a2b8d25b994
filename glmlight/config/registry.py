"""The algorithm registry: name → (LightningModule class, config schema).

Every algorithm module registers itself where it is defined:

    @register_algorithm("grpo", GRPOConfig)
    class GRPO(RLModule): ...

Registering stores the schema in Hydra's ConfigStore as `algo/<name>_schema`, which
`conf/algo/<name>.yaml` extends (`defaults: [<name>_schema]`), so `algo.name=<name>`
validates against the algorithm's own dataclass. An algorithm from another package
registers the same way; with `default_config=True` it also gets `algo=<name>` without a
YAML file of its own (the schema's defaults are the config). Such a package is found by
`discover()` when it declares an entry point in the group `glmlight.algorithms` (its value
is the module to import), or simply by being imported before `glmlight.compose` / `build`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Callable, TypeVar

from hydra.core.config_store import ConfigStore

from glmlight.errors import ConfigError

T = TypeVar("T", bound=type)


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    module: type  # an RLModule subclass
    schema: type  # its config dataclass (an AlgoConfig subclass)


ALGORITHMS: dict[str, AlgorithmSpec] = {}
BUILTIN = "glmlight.algorithms"  # imported (by name) on the first lookup: its modules register themselves
ENTRY_POINT_GROUP = "glmlight.algorithms"
_discovered = False


def register_algorithm(name: str, schema: type, *, default_config: bool = False) -> Callable[[T], T]:
    """Class decorator: register `cls` as algorithm `name` with config dataclass `schema`."""

    def register(cls: T) -> T:
        ALGORITHMS[name] = AlgorithmSpec(name, cls, schema)
        store = ConfigStore.instance()
        store.store(group="algo", name=f"{name}_schema", node=schema)
        if default_config:
            store.store(group="algo", name=name, node=schema(name=name))
        return cls

    return register


def discover() -> dict[str, AlgorithmSpec]:
    """Import the built-in algorithms and every `glmlight.algorithms` entry point (once)."""
    global _discovered
    if not _discovered:
        _discovered = True
        importlib.import_module(BUILTIN)
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            importlib.import_module(ep.value)
    return ALGORITHMS


def algorithm(name: str) -> AlgorithmSpec:
    """The registered algorithm `name`; a ConfigError naming the registered ones otherwise."""
    if name not in ALGORITHMS:
        discover()
    if name not in ALGORITHMS:
        raise ConfigError(f"config error: algo.name={name!r} is not an algorithm; choose one of {sorted(ALGORITHMS)}")
    return ALGORITHMS[name]
