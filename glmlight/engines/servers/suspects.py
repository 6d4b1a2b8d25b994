"""The per-server bookkeeping of a fleet (`Suspects`, held by `ServerFleet`, fleet.py): the weight-version
label each server must report, the version each serves, and the servers marked out.

An answer labelled with other weights than its server must serve is stale; a server that dropped a
connection or answered stale is marked out (a suspect): the fleet's pool sends it requests only when no
other server is left, and before the next call the fleet probes it and, if it restarted on other weights,
re-syncs it (`ServerFleet.sync_suspects`); then it is marked back in. `mark_out` and `mark_in` are the
only places a server leaves or rejoins the rotation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from glmlight.engines.servers.protocol import Answer


class Suspects:
    """See the module docstring. `out` is the set the fleet's pool avoids (`UrlPool.avoid`)."""

    def __init__(self, urls: Sequence[str], version: int, on_out: Callable[[str], None] | None = None,
                 on_in: Callable[[str], None] | None = None):
        self.expect: dict[str, str | None] = {}  # url -> the label it must report (None: its start-up weights)
        self.versions: dict[str, int] = {u: version for u in urls}  # url -> the version it serves
        self.out: set[str] = set()
        # what else follows a server out of and back into rotation (a managed router's worker list)
        self.on_out, self.on_in = on_out, on_in

    # ------------------------------------------------------------------ rotation
    def mark_out(self, url: str) -> None:
        """`url` may serve other weights than it must: avoided, probed before the next call."""
        self.out.add(url)
        if self.on_out is not None:
            self.on_out(url)

    def mark_in(self, url: str) -> None:
        """`url` serves what it must again."""
        was_out = url in self.out
        self.out.discard(url)
        if was_out and self.on_in is not None:
            self.on_in(url)

    def __contains__(self, url: object) -> bool:
        return url in self.out

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.out))

    def __bool__(self) -> bool:
        return bool(self.out)

    # ------------------------------------------------------------------ expectations
    def watch(self, url: str) -> None:
        """Check `url`'s answers from now on (it serves its start-up weights)."""
        self.expect[url] = None

    def served(self, urls: Sequence[str], version: int) -> None:
        """`urls` loaded `version`: their answers must carry its label."""
        for u in urls:
            self.expect[u], self.versions[u] = str(version), version

    def is_stale(self, a: Answer) -> bool:
        """Whether `a` came from other weights than its server must serve (the server is then marked out)."""
        want = self.expect.get(a.url)
        if want is None or not a.labels:
            return False
        if all(label == want for label in a.labels):
            return False
        self.mark_out(a.url)
        return True

    def versions_of(self, a: Answer, version: int) -> list[int]:
        """The version of every token of `a` (its server's; `version` for a server not tracked)."""
        return [self.versions.get(a.url, version)] * len(a.gen.token_ids)

    def unlabelled(self, labels_answers: Callable[[str], bool]) -> list[str]:
        """The servers whose answers carry no version and whose version matters (asked before every call)."""
        return [u for u, want in self.expect.items() if want is not None and not labels_answers(u)]

    def on_server_error(self, url: str, connection_lost: bool) -> None:
        """The HTTP client's report of a failed attempt: a lost connection may be a restart."""
        if connection_lost and url in self.expect:
            self.mark_out(url)
