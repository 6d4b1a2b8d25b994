"""Delta weight sync: send only the elements that changed since the last committed update.

A training step at RL learning rates moves most weights by less than half a step of the server's
bfloat16, so most bf16 values stay the same from one sync to the next (docs/performance.md measures
the share on SmolLM2). For servers on other machines, where the bytes on the wire are the cost, a
tensor whose elements mostly did not change is sent as a bitmask of the changed elements (one bit
per element) and their new values; a tensor that changed too much to gain goes whole. Both sides
keep the last committed tensors, in the served dtype, as the base the next delta applies to; the
base is named by the version that committed it, and an update whose base the receiver does not hold
is refused (the sender then sends everything). Elements are compared by their bits (a NaN, -0.0 and
+0.0 are each themselves), so the receiver rebuilds exactly the sender's tensors.

On the wire a delta is two ordinary named tensors, `<name>.__delta_mask` (uint8, bits in little
order) and `<name>.__delta_values`, so buckets and the safetensors encoding carry it unchanged; the
receiver expands the whole update at commit, whichever buckets the pieces came in.

This module imports torch only: it runs inside the vLLM worker too (servers/worker/vllm_extension.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

MASK, VALUES = ".__delta_mask", ".__delta_values"
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)

Named = list[tuple[str, torch.Tensor]]


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A 1-D bool tensor as uint8, eight elements a byte, element i in bit i % 8 of byte i // 8."""
    n = mask.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8)
    padded[:n] = mask.reshape(-1).to(torch.uint8)
    return (padded.view(-1, 8) * _BIT_WEIGHTS).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `pack_bits`: the first n bits as a 1-D bool tensor."""
    if packed.numel() != (n + 7) // 8:
        raise ValueError(f"a bitmask of {n} elements has {(n + 7) // 8} bytes, got {packed.numel()}")
    bits = packed.reshape(-1, 1).bitwise_and(_BIT_WEIGHTS).ne(0)
    return bits.reshape(-1)[:n]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(_INT_OF_SIZE[t.element_size()])


def encode(named: Iterable[tuple[str, torch.Tensor]],
           base: dict[str, torch.Tensor] | None) -> tuple[Named, dict[str, Any]]:
    """The update as it goes on the wire: each tensor whole, or as mask + values where that is smaller
    (a base tensor of the same name, shape and dtype exists). Returns (wire tensors, stats): `bytes` sent,
    `full_bytes` of the tensors whole, `changed` and `elements` over the tensors compared."""
    base = base or {}
    wire: Named = []
    sent = full = changed = compared = 0
    for name, t in named:
        size = t.numel() * t.element_size()
        full += size
        old = base.get(name)
        if old is None or old.shape != t.shape or old.dtype != t.dtype or t.element_size() not in _INT_OF_SIZE:
            wire.append((name, t))
            sent += size
            continue
        diff = _bits(t) != _bits(old)
        k = int(diff.sum())
        changed, compared = changed + k, compared + t.numel()
        delta = (t.numel() + 7) // 8 + k * t.element_size()
        if delta >= size:
            wire.append((name, t))
            sent += size
            continue
        wire += [(name + MASK, pack_bits(diff)), (name + VALUES, t.reshape(-1)[diff].clone())]
        sent += delta
    return wire, {"bytes": sent, "full_bytes": full, "changed": changed, "elements": compared}


def expand(wire: Iterable[tuple[str, torch.Tensor]], base: dict[str, torch.Tensor] | None) -> Named:
    """The whole tensors of an update from its wire form and the receiver's base (what `encode` was given).
    Raises ValueError for a delta without its base tensor, or a mask and values that disagree."""
    base = base or {}
    whole: dict[str, torch.Tensor | None] = {}
    masks: dict[str, torch.Tensor] = {}
    values: dict[str, torch.Tensor] = {}
    for name, t in wire:
        for suffix, into in ((MASK, masks), (VALUES, values)):
            if name.endswith(suffix):
                name = name[: -len(suffix)]
                into[name] = t
                whole.setdefault(name, None)
                break
        else:
            whole[name] = t
    for name in [n for n, t in whole.items() if t is None]:
        if name not in base:
            raise ValueError(f"a delta for {name!r} arrived, but this side holds no base tensor for it")
        if name not in masks or name not in values:
            raise ValueError(f"the delta for {name!r} lacks its {'mask' if name not in masks else 'values'}")
        old = base[name]
        mask = unpack_bits(masks[name], old.numel())
        if int(mask.sum()) != values[name].numel():
            raise ValueError(f"the delta for {name!r} marks {int(mask.sum())} changed elements but carries "
                             f"{values[name].numel()} values")
        new = old.reshape(-1).clone()
        new[mask] = values[name].to(old.dtype)
        whole[name] = new.view(old.shape)
    return [(n, t) for n, t in whole.items() if t is not None]


# ---------------------------------------------------------------------------------------------- sender
class DeltaSender:
    """The sender's side: the tensors of the last committed version, in the served dtype, and that version.
    `wire` → (the update is committed everywhere) `committed`, or (anything failed) `forget`, after which
    the next update goes whole."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] | None = None
        self.version: str | None = None
        self.last: dict[str, Any] = {}
        self._pending: Named | None = None

    def wire(self, named: Iterable[tuple[str, torch.Tensor]], dtype: str | None, whole: bool = False) -> Named:
        """The update's wire tensors: cast to the served `dtype` (None: as they are), then diffed against
        the base unless `whole`."""
        from glmlight.dtypes import parse_dtype

        to = parse_dtype(dtype) if dtype else None
        cast = [(n, t.detach().to("cpu", to or t.dtype, copy=True)) for n, t in named]
        wire, self.last = encode(cast, None if whole else self.base)
        self._pending = cast
        return wire

    def commit_spec(self, whole: bool = False) -> dict[str, Any]:
        """What the commit call adds: the version the delta is against (None: sent whole) and that the
        receiver keeps the result as its next base."""
        return {"delta_base": None if whole or self.base is None else self.version, "keep_base": True}

    def committed(self, version: int | str, resync: bool = False) -> None:
        """Every server committed: the sent tensors are the new base (a re-sync sent the current base again)."""
        if not resync and self._pending is not None:
            self.base, self.version = dict(self._pending), str(version)
        self._pending = None

    def forget(self) -> None:
        self.base = self.version = self._pending = None


# ---------------------------------------------------------------------------------------------- receiver
class DeltaBase:
    """The receiver's side, kept in a dict (`state`, e.g. a vLLM worker's `__dict__`): the base tensors
    and the version that committed them."""

    KEY = "_gl_delta_base"

    @classmethod
    def expand_update(cls, state: dict[str, Any], wire: Named, spec: dict[str, Any]) -> Named:
        """The staged update as whole tensors. `spec["delta_base"]`: the version the sender diffed against
        (None: it sent everything); a base this side does not hold is refused."""
        want = spec.get("delta_base")
        if want is None:
            return list(wire)
        held = state.get(cls.KEY)
        if held is None or held["version"] != str(want):
            raise RuntimeError(f"the update is a delta against version {want}, but this server holds "
                               f"{'no base' if held is None else 'the base of version ' + held['version']}")
        return expand(wire, held["tensors"])

    @classmethod
    def keep(cls, state: dict[str, Any], named: Named, spec: dict[str, Any]) -> None:
        """After a commit with `spec["keep_base"]`: the committed tensors become the next base."""
        if spec.get("keep_base"):
            state[cls.KEY] = {"version": str(spec["version"]), "tensors": {n: t.detach() for n, t in named}}

    @classmethod
    def current(cls, state: dict[str, Any]) -> Any:
        return state.get(cls.KEY)

    @classmethod
    def restore(cls, state: dict[str, Any], held: Any) -> None:
        """A reverted commit: the base it replaced comes back."""
        if held is None:
            state.pop(cls.KEY, None)
        else:
            state[cls.KEY] = held
