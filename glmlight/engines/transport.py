"""Weight transport: what every weight sync shares, whichever engine receives it.

- named tensors as detached CPU copies (`cpu_tensors`) and in buckets of bounded size (`buckets`);
- the checkpoint layout of `weight_sync=disk`: a Hugging Face directory of safetensors files
  named with the model's own state-dict names (what a server's `load_weights` maps from), plus
  config.json, written atomically (`write_hf_checkpoint`) and read back (`read_checkpoint`);
- the same files written and read through a memory map (`write_mapped_safetensors`,
  `map_checkpoint`): in shared memory (`weight_sync=shm`, /dev/shm) a server on the same host maps
  the trainer's bytes, and each byte is copied once on each side;
- safetensors payloads (base64) for tensors sent inside a JSON body;
- a weight-update process group outside the trainer's default group (rank 0 = trainer,
  servers from `rank_offset`), built the way SGLang builds its own, so both sides meet.

Used by the embedded engine, the SGLang and vLLM clients and the vLLM worker extension (inside
vLLM's workers). Imports only torch and safetensors (and glmlight's light package init), so a
server's environment needs nothing else of glmlight.
"""

from __future__ import annotations

import base64
import datetime
import json
import mmap
import os
import re
import shutil
import struct
from collections.abc import Iterable, Iterator

import torch
from safetensors.torch import load, load_file, save, save_file

Named = list[tuple[str, torch.Tensor]]


def cpu_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> Named:
    """Detached, contiguous CPU copies; tensors that share storage (tied weights) are
    cloned so that safetensors accepts them."""
    out, seen = [], set()
    for name, t in named:
        t = t.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(key)
        out.append((name, t))
    return out


def buckets(named: Named, max_bytes: int) -> Iterator[Named]:
    """Consecutive groups of at most `max_bytes` (a larger tensor travels alone)."""
    bucket, size = [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if bucket and size + n > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def write_hf_checkpoint(named: Iterable[tuple[str, torch.Tensor]], root: str, version: int, *,
                        config_dir: str | None = None, max_shard_bytes: int = 5 * 2**30, keep: int = 2) -> str:
    """Write `root/v{version}/` atomically and return its absolute path.

    Files are written into a temporary directory (each file to a temp name, then
    os.replace), which is then renamed to `v{version}`; a reader never sees a partial
    checkpoint. One shard is `model.safetensors`; more are `model-0000i-of-0000N.safetensors`
    with `model.safetensors.index.json`. Older `v*` directories beyond `keep` are removed.
    """
    root = os.path.abspath(root)
    final = os.path.join(root, f"v{version}")
    tmp = os.path.join(root, f".v{version}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    shards = list(buckets(cpu_tensors(named), max_shard_bytes))
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards):
        part = os.path.join(tmp, fname + ".part")
        save_file(dict(shard), part, metadata={"format": "pt"})
        os.replace(part, os.path.join(tmp, fname))
        for name, t in shard:
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    if len(shards) > 1:
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    for extra in ("config.json", "generation_config.json"):
        if config_dir and os.path.isfile(os.path.join(config_dir, extra)):
            shutil.copyfile(os.path.join(config_dir, extra), os.path.join(tmp, extra))
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    _prune(root, keep)
    return final


def checkpoint_versions(root: str) -> list[int]:
    """The versions N of the `root/vN/` checkpoints `write_hf_checkpoint` has written, oldest first
    (none: [], also when `root` does not exist yet)."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(m.group(1)) for d in names if (m := re.fullmatch(r"v(\d+)", d)))


def _prune(root: str, keep: int) -> None:
    for v in checkpoint_versions(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(root, f"v{v}"), ignore_errors=True)


def read_checkpoint(path: str) -> Named:
    """Tensors of a safetensors file or of a directory of safetensors files (sorted by name)."""
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path}")
        return [item for f in files for item in load_file(os.path.join(path, f)).items()]
    return list(load_file(path).items())


# safetensors' dtype names (the format's specification, safetensors 0.4+)
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                      torch.float8_e5m2: "F8_E5M2"}
_FROM_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def write_mapped_safetensors(named: Iterable[tuple[str, torch.Tensor]], path: str,
                             maps: dict[str, tuple[bytes, mmap.mmap]] | None = None) -> int:
    """Write a safetensors file by copying each tensor once, straight into the file's mapped pages
    (`save_file` first serialises every tensor into a bytes object, then writes it: two copies).
    Tensors are laid out largest element first, so every tensor starts aligned to its element size
    in the file. A file of the same layout is overwritten in place: its pages exist already (in
    /dev/shm a new file costs a page fault and a zeroed page per 4 KiB, about as much as the copy).
    `maps` (path -> (header, map)) keeps the mapping open for the next write of that path, which is
    then a plain memcpy; whoever passes it closes the maps. The bytes written."""
    items = sorted(((n, t.detach().cpu()) for n, t in named), key=lambda it: -it[1].element_size())
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in items:
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned (the format allows trailing spaces)
    base, total = 8 + len(head), 8 + len(head) + offset
    prefix = struct.pack("<Q", len(head)) + head
    kept = (maps or {}).get(path)
    if kept is not None and (kept[0] != prefix or not os.path.isfile(path)):
        maps.pop(path)[1].close()  # type: ignore[union-attr]
        kept = None
    if kept is not None:
        mm = kept[1]
    else:
        same = os.path.isfile(path) and os.path.getsize(path) == total and _prefix(path, base) == prefix
        with open(path, "r+b" if same else "w+b") as f:
            if not same:
                f.truncate(total)
            mm = mmap.mmap(f.fileno(), total, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        mm[:base] = prefix
    try:
        if offset:
            data = torch.frombuffer(mm, dtype=torch.uint8, count=offset, offset=base)
            for name, t in items:
                start, end = header[name]["data_offsets"]
                if end > start:
                    data[start:end].view(t.dtype).view(t.shape).copy_(t)
            del data  # the map cannot close while a tensor still points into it
    finally:
        if maps is None:
            mm.close()
        else:
            maps[path] = (prefix, mm)
    return total


def _prefix(path: str, n: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


class SharedMemorySlots:
    """`weight_sync=shm`: two checkpoint directories in shared memory (`root`, /dev/shm by default),
    written in turn: an update goes into the slot the servers do not serve from, so the served
    version's files stay whole for a rollback, and once both exist every update is a memcpy into
    pages that are already there and stay mapped. Each slot holds one safetensors file written through a memory map, plus
    the model's config.json. Removed by `close`."""

    def __init__(self, root: str = "/dev/shm", config_dir: str | None = None):
        import tempfile

        if not os.path.isdir(root):
            raise FileNotFoundError(f"weight_sync=shm: {root} does not exist (a shared-memory filesystem such as "
                                    "/dev/shm; set rollout.server.weight_sync_dir to one)")
        self.dir = tempfile.mkdtemp(prefix="glmlight-weights-", dir=root)
        self.config_dir = config_dir
        self._maps: dict[str, tuple[bytes, mmap.mmap]] = {}  # each slot's file stays mapped between writes

    def write(self, named: Iterable[tuple[str, torch.Tensor]], served: str | None) -> str:
        """Write `named` into the slot that is not `served` (the directory the servers now load from);
        its path."""
        slot = next(p for p in (os.path.join(self.dir, "a"), os.path.join(self.dir, "b"))
                    if p != (served and os.path.abspath(served)))
        os.makedirs(slot, exist_ok=True)
        write_mapped_safetensors(named, os.path.join(slot, "model.safetensors"), self._maps)
        for extra in ("config.json", "generation_config.json"):
            src = os.path.join(self.config_dir or "", extra)
            if self.config_dir and os.path.isfile(src) and not os.path.exists(os.path.join(slot, extra)):
                shutil.copyfile(src, os.path.join(slot, extra))
        return slot

    def close(self) -> None:
        for _, mm in self._maps.values():
            mm.close()
        self._maps.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def map_checkpoint(path: str) -> Named:
    """The tensors of a safetensors file (or of a directory of them), as views of the file mapped
    copy-on-write: nothing is read until a tensor is used, and reading a file in /dev/shm touches
    the writer's pages. The views keep the map alive (the file may be removed meanwhile)."""
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path}")
        return [item for f in files for item in map_checkpoint(os.path.join(path, f))]
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    (n,) = struct.unpack("<Q", mm[:8])
    header = json.loads(mm[8:8 + n])
    base = 8 + n
    if len(mm) == base:
        return [(name, torch.empty(meta["shape"], dtype=_FROM_SAFETENSORS[meta["dtype"]]))
                for name, meta in header.items() if name != "__metadata__"]
    data = torch.frombuffer(mm, dtype=torch.uint8, count=len(mm) - base, offset=base)
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        dtype = _FROM_SAFETENSORS[meta["dtype"]]
        view = data[start:end]
        if start % torch.empty((), dtype=dtype).element_size():  # a file written by another writer
            view = view.clone()
        out.append((name, view.view(dtype).view(meta["shape"])))
    return out


def encode_safetensors(named: Named) -> str:
    return base64.b64encode(save(dict(cpu_tensors(named)))).decode("ascii")


def decode_safetensors(data: str) -> Named:
    return list(load(base64.b64decode(data)).items())


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout_s: float = 600.0):
    """A process group of its own (not the default group): TCP rendezvous at `init_method`,
    the store prefixed with `group_name`. SGLang's server side builds its weight-update
    group the same way, so trainer and servers meet. Uses torch internals, as SGLang does."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def sync_device(backend: str) -> torch.device:
    """Where broadcast tensors live: nccl → cuda, hccl → npu, gloo → cpu."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "hccl":
        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    return torch.device("cpu")


def load_weights_file(path: str) -> dict[str, torch.Tensor]:
    """Tensors of a Hugging Face checkpoint directory (through transformers, which maps its
    on-disk names to the model's), of a directory of raw *.safetensors files, or of one file."""
    from glmlight.errors import EngineError  # not at import time: vLLM workers import this module alone

    if os.path.isfile(os.path.join(path, "config.json")):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True).state_dict()
    if not os.path.exists(path):
        raise EngineError(f"weight file {path} does not exist")
    try:
        return dict(read_checkpoint(path))
    except FileNotFoundError as e:
        raise EngineError(str(e)) from None
