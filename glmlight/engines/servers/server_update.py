"""One all-or-nothing weight update of a server fleet (a mixin of `ServerEngineBase`,
glmlight/engines/servers/base.py): pause every server → push (the engine's `_push`) → flush caches →
confirm every server reports the new version → resume → verify; and the check, before any server is
touched, that the new tensors have the served model's shapes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Callable

import torch

from glmlight.errors import EngineError
from glmlight.engines.servers.server_checks import verify_update
from glmlight.engines.servers.server_types import FleetFailed, Source, UpdateFailed

log = logging.getLogger("glmlight.engines.servers.base")


class FleetUpdate:
    """The fleet update of ServerEngineBase (glmlight/engines/servers/base.py); what it reads from the engine,
    the protocol hooks `_pause`, `_push`, `_flush`, `_resume`, `_served_label` included, is declared below."""

    # read from the class this is part of, defined there
    name: str
    http: Any
    resync: bool
    verify_updates: bool
    confirm_timeout_s: float
    poll_interval_s: float
    _version: int
    _current: Any
    _expect: Any
    _url_version: Any
    _suspects: Any
    _pause: Callable[..., Any]
    _push: Callable[..., Any]
    _flush: Callable[..., Any]
    _resume: Callable[..., Any]
    _served_label: Callable[..., Any]

    def _update_fleet(self, urls: Sequence[str], named: list | None, path: str | None, version: int,
                      fingerprint: torch.Tensor | None) -> Source:
        try:
            self._run_all(self._pause, urls)
        except EngineError as e:
            self._resume_all(urls)
            raise UpdateFailed(f"could not pause every server: {e}") from None
        try:
            try:
                source = self._push(urls, named, path, version)
            except (UpdateFailed, FleetFailed):
                raise
            except EngineError as e:  # the fleet's state is not known any more
                self._failed = f"{self.name}: a weight update to version {version} failed half-way: {e}"
                raise FleetFailed(self._failed) from None
            for u in urls:
                self._expect[u], self._url_version[u] = str(version), version
            try:
                self._run_all(self._flush, urls)
                self._confirm_version(urls, version)
            except FleetFailed:
                raise
            except EngineError as e:  # the new weights are in, but not flushed or not acknowledged
                self._failed = f"{self.name}: servers loaded weight version {version} but then failed: {e}"
                raise FleetFailed(self._failed) from None
        finally:
            self._resume_all(urls)
        if source.named is None and source.path is None and self.resync and named is not None:
            source.named = [(n, t.detach().to("cpu", copy=True)) for n, t in named]  # re-syncs and reverts
        self._verify(urls, version, fingerprint)
        self._suspects.difference_update(urls)
        return source

    def _check_shapes(self, named: list, version: int) -> None:
        """Refuse, before any server is touched, a tensor whose shape differs from the served model's
        (the checkpoint the servers started from, `model_path`, and every update since). A server may
        not refuse it itself: SGLang 0.5.23 on CPU answered a q_proj one row short with success and
        served it (tests/integration/servers/test_real_servers.py)."""
        if self._shapes is None:
            self._shapes = checkpoint_shapes(getattr(self, "model_path", None))
        for name, t in named:
            want = self._shapes.get(name)
            if want is not None and tuple(t.shape) != want:
                raise EngineError(f"{self.name}: weight update to version {version} refused: tensor {name} has the "
                                  f"wrong shape {list(t.shape)}, the served model's is {list(want)}; every server "
                                  f"still serves version {self._version}")
        self._shapes.update({name: tuple(t.shape) for name, t in named})

    def _resume_all(self, urls: Sequence[str]) -> None:
        try:
            self._run_all(self._resume, urls)
        except Exception as e:  # noqa: BLE001 - keep the original error, if any
            log.warning("%s: could not resume generation: %s", self.name, e)

    def _previous(self) -> Source:
        """The weights every server serves now (what a failed update goes back to)."""
        return self._current

    def _verify(self, urls: Sequence[str], version: int, fingerprint: torch.Tensor | None) -> None:
        if self.verify_updates:
            verify_update(self, urls, version, fingerprint)

    def _run_all(self, hook: Any, urls: Sequence[str]) -> None:
        async def all_() -> None:
            await asyncio.gather(*(hook(u) for u in urls))

        self.http.run(all_())

    def _confirm_version(self, urls: Sequence[str], version: int) -> None:
        deadline = time.monotonic() + self.confirm_timeout_s
        for url in urls:
            while True:
                served = self.http.run(self._served_label(url))
                if served == str(version):
                    break
                if time.monotonic() > deadline:
                    self._failed = (f"{self.name} server at {url} still reports weight version {served!r} "
                                    f"{self.confirm_timeout_s:g}s after the update, expected {str(version)!r}")
                    raise FleetFailed(self._failed)
                time.sleep(self.poll_interval_s)


def checkpoint_shapes(path: str | None) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the safetensors headers of a local checkpoint directory ({} when
    there is none here, e.g. a server's own path on another host; a file that cannot be read is left out)."""
    import glob
    import os

    from safetensors import SafetensorError

    from glmlight.engines.servers.worker_checks import checkpoint_shapes as file_shapes

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))) if path and os.path.isdir(path) else []:
        try:
            shapes.update(file_shapes(f))
        except (OSError, ValueError, SafetensorError):
            continue
    return shapes
