"""The files of weight_sync=shm: a safetensors file written through a memory map reads back exactly
(with safetensors' own reader too), maps back as views, and two slots alternate and are overwritten
in place."""

import os

import pytest
import torch
from safetensors.torch import load_file

from glmlight.engines import transport as wt


def _named():
    torch.manual_seed(0)
    return [("a.weight", torch.randn(3, 4)), ("b", torch.randn(5).bfloat16()), ("c", torch.arange(7)),
            ("empty", torch.zeros(0, 3)), ("t", torch.randn(4, 3).t()), ("h", torch.randn(3).half()),
            ("mask", torch.tensor([True, False, True]))]


def test_a_mapped_file_is_a_safetensors_file_with_the_same_tensors(tmp_path):
    path = str(tmp_path / "m.safetensors")
    nbytes = wt.write_mapped_safetensors(_named(), path)
    assert nbytes == os.path.getsize(path)
    theirs, ours = load_file(path), dict(wt.map_checkpoint(path))
    for name, t in _named():
        assert theirs[name].dtype == ours[name].dtype == t.dtype and torch.equal(theirs[name], t), name
        assert torch.equal(ours[name], t) and ours[name].shape == t.shape, name


def test_mapped_views_survive_the_file_and_writing_them_does_not_touch_it(tmp_path):
    path = str(tmp_path / "m.safetensors")
    wt.write_mapped_safetensors([("x", torch.ones(1024))], path)
    (_, x), = wt.map_checkpoint(path)
    x.mul_(3)  # copy-on-write: the file keeps its ones
    assert torch.equal(load_file(path)["x"], torch.ones(1024))
    os.remove(path)
    assert float(x.sum()) == 3 * 1024


def test_an_unknown_dtype_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="w: dtype torch.complex64"):
        wt.write_mapped_safetensors([("w", torch.zeros(2, dtype=torch.complex64))], str(tmp_path / "m.safetensors"))


def test_shared_memory_slots_alternate_keep_the_served_one_and_overwrite_in_place(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    slots = wt.SharedMemorySlots(str(tmp_path), config_dir=str(tmp_path))
    first = slots.write([("w", torch.zeros(4))], served=None)
    second = slots.write([("w", torch.ones(4))], served=first)
    assert first != second and os.path.isfile(os.path.join(second, "config.json"))
    inode = os.stat(os.path.join(first, "model.safetensors")).st_ino
    third = slots.write([("w", torch.full((4,), 2.0))], served=second)
    assert third == first and os.stat(os.path.join(third, "model.safetensors")).st_ino == inode  # in place
    assert torch.equal(load_file(os.path.join(second, "model.safetensors"))["w"], torch.ones(4))  # served: whole
    assert torch.equal(dict(wt.map_checkpoint(third))["w"], torch.full((4,), 2.0))
    fourth = slots.write([("w", torch.zeros(5))], served=third)  # another layout: a new file
    assert torch.equal(dict(wt.map_checkpoint(fourth))["w"], torch.zeros(5))
    slots.close()
    assert not os.path.exists(slots.dir)


def test_slots_need_a_directory_that_exists(tmp_path):
    with pytest.raises(FileNotFoundError, match="weight_sync=shm: .* does not exist"):
        wt.SharedMemorySlots(str(tmp_path / "missing"))
