"""PromptStream: the prompts one rank trains on, in order, and the ids of what is generated.

The stream walks the source in a seeded permutation per epoch (reshuffled every epoch),
sharded across data-parallel ranks; prompts whose generation a weight update aborted come
back first. It also hands out group and rollout ids. Its position is part of a checkpoint, so
a resumed run continues with exactly the prompts it would have drawn. Thread-safe: the async
producer draws from it while the trainer saves it.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import threading
from typing import Any

from glmlight.prompt import Prompt, PromptSource
from glmlight.errors import DataError


class PromptStream:
    def __init__(self, source: PromptSource, seed: int, rank: int = 0, world_size: int = 1):
        self.source, self.seed = source, seed
        self.rank, self.world_size = rank, world_size
        self.lock = threading.RLock()
        self.cursor = 0  # prompts drawn from the source by this rank
        self.next_rollout_id = 0
        self.next_group_id = 0
        self.requeued: list[int] = []  # source indexes to generate again, drawn before the stream

    def shard(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def index(self, k: int) -> int:
        """The source index of this rank's k-th prompt."""
        k = k * self.world_size + self.rank
        n = len(self.source)
        epoch, pos = divmod(k, n)
        if n > 1_000_000:  # synthetic sources are already random per index
            return pos
        return _epoch_order(self.seed, epoch, n)[pos]

    def draw(self, n: int) -> list[Prompt]:
        """The next n prompts (requeued ones first), each tagged with metadata["prompt_index"]."""
        with self.lock:
            indexes, self.requeued = self.requeued[:n], self.requeued[n:]
            fresh = n - len(indexes)
            indexes += [self.index(self.cursor + i) for i in range(fresh)]
            self.cursor += fresh
        out = []
        for i in indexes:
            p = self.source[i]
            out.append(dataclasses.replace(p, metadata={**p.metadata, "prompt_index": i}))
        return out

    def requeue(self, prompt_index: int) -> None:
        with self.lock:
            self.requeued.append(prompt_index)

    def new_group_id(self) -> int:
        with self.lock:
            self.next_group_id += 1
            return self.next_group_id - 1

    def take_rollout_ids(self, k: int) -> int:
        """Reserve k consecutive rollout ids; returns the first."""
        with self.lock:
            start = self.next_rollout_id
            self.next_rollout_id += k
            return start

    def state_dict(self, cursor: int | None = None) -> dict[str, Any]:
        """The position; `cursor` replaces it (prompts being generated now will be drawn again)."""
        with self.lock:
            return {"cursor": self.cursor if cursor is None else cursor, "next_rollout_id": self.next_rollout_id,
                    "next_group_id": self.next_group_id, "requeued": list(self.requeued),
                    "source": self.source_identity()}

    def source_identity(self) -> dict[str, Any]:
        """What the saved position refers to: the source's length, and its fingerprint when it has one."""
        return {"prompts": len(self.source), **(getattr(self.source, "fingerprint", None) or {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved, now = state.get("source"), self.source_identity()
        if saved is not None and (saved.get("prompts") != now["prompts"] or saved.get("sha256") != now.get("sha256")):
            what = saved.get("path") or "the prompt source"
            raise DataError(f"{what} is not what this checkpoint was trained on ({saved.get('prompts')} prompts, "
                            f"sha256 {str(saved.get('sha256'))[:12]} then; {now['prompts']} prompts, sha256 "
                            f"{str(now.get('sha256'))[:12]} now): the saved position would point at other prompts. "
                            "Restore the file, or start a new run")
        with self.lock:
            self.cursor = state["cursor"]
            self.next_rollout_id = state["next_rollout_id"]
            self.next_group_id = state["next_group_id"]
            self.requeued = list(state.get("requeued", []))


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    """The prompt order of one epoch (computed once per epoch, not once per prompt)."""
    order = list(range(n))
    random.Random(seed * 7919 + epoch).shuffle(order)
    return tuple(order)
