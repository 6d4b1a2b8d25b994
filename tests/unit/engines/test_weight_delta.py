"""Delta weight sync's wire form (glmlight/engines/weight_delta.py), with numbers worked out by hand."""

import pytest
import torch

from glmlight.engines.transport import decode_safetensors, encode_safetensors
from glmlight.engines.weight_delta import MASK, VALUES, DeltaBase, encode, expand, pack_bits, unpack_bits


def test_bits_pack_eight_to_a_byte_in_little_order():
    mask = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 0, 1], dtype=torch.bool)
    packed = pack_bits(mask)
    # byte 0: bits 0, 2, 3 -> 1 + 4 + 8 = 13; byte 1: bit 1 (element 9) -> 2
    assert packed.tolist() == [13, 2] and packed.dtype == torch.uint8
    assert torch.equal(unpack_bits(packed, 10), mask)
    with pytest.raises(ValueError, match="10 elements has 2 bytes, got 1"):
        unpack_bits(packed[:1], 10)


def test_a_tensor_that_barely_changed_goes_as_mask_and_values():
    old = torch.zeros(64, dtype=torch.bfloat16)
    new = old.clone()
    new[[3, 40]] = torch.tensor([0.5, -2.0], dtype=torch.bfloat16)
    wire, stats = encode([("w", new)], {"w": old})
    assert [n for n, _ in wire] == ["w" + MASK, "w" + VALUES]
    # 64 elements: an 8-byte mask + 2 values x 2 bytes = 12 bytes instead of 128
    assert stats == {"bytes": 12, "full_bytes": 128, "changed": 2, "elements": 64}
    assert wire[1][1].tolist() == [0.5, -2.0]
    (name, back), = expand(wire, {"w": old})
    assert name == "w" and torch.equal(back.view(torch.int16), new.view(torch.int16))


def test_whole_tensors_where_a_delta_would_not_be_smaller_or_there_is_no_base():
    old = torch.zeros(8, dtype=torch.float32)
    changed = torch.arange(8, dtype=torch.float32)  # 7 of 8 changed: 1 + 28 bytes > 32? no: 29 < 32 -> delta
    every = torch.arange(1, 9, dtype=torch.float32)  # 8 of 8: 1 + 32 > 32 -> whole
    wire, stats = encode([("a", changed), ("b", every), ("c", torch.ones(2)), ("d", torch.ones(3))],
                         {"a": old, "b": old, "d": torch.ones(4)})
    assert [n for n, _ in wire] == ["a" + MASK, "a" + VALUES, "b", "c", "d"]  # c: no base; d: another shape
    assert stats == {"bytes": 29 + 32 + 8 + 12, "full_bytes": 32 + 32 + 8 + 12, "changed": 15, "elements": 16}
    assert dict(expand(wire, {"a": old})).keys() == {"a", "b", "c", "d"}


def test_bits_not_values_decide_what_changed():
    old = torch.tensor([0.0, float("nan"), 1.0])
    new = torch.tensor([-0.0, float("nan"), 1.0])  # -0.0 == 0.0 as values, but another bit pattern
    wire, stats = encode([("w", new)], {"w": old})
    assert stats["changed"] == 1
    (_, back), = expand(wire, {"w": old})
    assert torch.equal(back.view(torch.int32), new.view(torch.int32))


def test_the_wire_form_survives_the_safetensors_encoding_and_buckets_split_anywhere():
    torch.manual_seed(0)
    old = {f"layer{i}": torch.randn(16, 8).bfloat16() for i in range(3)}
    new = {k: v.clone() for k, v in old.items()}
    new["layer1"][2, 3] += 1.0
    wire, _ = encode(new.items(), old)
    halves = [wire[:2], wire[2:]]  # the mask in one bucket, its values in the next
    back = dict(expand([t for h in halves for t in decode_safetensors(encode_safetensors(h))], old))
    assert all(torch.equal(back[k].view(torch.int16), new[k].view(torch.int16)) for k in new)


def test_expand_refuses_what_it_cannot_rebuild():
    old = torch.zeros(16)
    new = old.clone()
    new[0] = 1.0
    wire, _ = encode([("w", new)], {"w": old})
    with pytest.raises(ValueError, match="no base tensor for it"):
        expand(wire, {})
    with pytest.raises(ValueError, match="lacks its values"):
        expand(wire[:1], {"w": old})
    with pytest.raises(ValueError, match="marks 1 changed elements but carries 2 values"):
        expand([wire[0], ("w" + VALUES, torch.ones(2))], {"w": old})


def test_the_receiver_applies_a_delta_only_to_the_base_it_was_made_against():
    state: dict = {}
    v1 = [("w", torch.zeros(16))]
    assert DeltaBase.expand_update(state, v1, {"version": 1}) == v1  # no delta_base: sent whole
    DeltaBase.keep(state, v1, {"version": 1, "keep_base": True})
    v2 = torch.zeros(16)
    v2[5] = 3.0
    wire, _ = encode([("w", v2)], dict(v1))
    (_, got), = DeltaBase.expand_update(state, wire, {"version": 2, "delta_base": 1})
    assert torch.equal(got, v2)
    with pytest.raises(RuntimeError, match="delta against version 7, but this server holds the base of version 1"):
        DeltaBase.expand_update(state, wire, {"delta_base": 7})
    held = DeltaBase.current(state)
    DeltaBase.keep(state, [("w", got)], {"version": 2, "keep_base": True})
    DeltaBase.restore(state, held)  # the commit of version 2 was reverted
    assert DeltaBase.current(state)["version"] == "1"
    with pytest.raises(RuntimeError, match="holds no base"):
        DeltaBase.expand_update({}, wire, {"delta_base": 1})
