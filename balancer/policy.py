"""Routing policies: which free worker gets the next batch (``dllm-serve balancer --routing-policy``).

A policy only orders the free workers (healthy, below --max-inflight-per-worker); the batcher sends the next batch
to the first of them that can take a queued request (a request that failed on a worker is not sent there again while
another worker is healthy). When a batch goes, and how large it is, stay the batcher's (--batch-size,
--batch-wait-time). Imports nothing beyond the standard library (``dllm_serve.cli`` lists the names)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from balancer.pool import Worker


class Policy:
    name = ""

    def rank(self, free: list[Worker]) -> list[Worker]:
        """``free`` (never empty), most preferred first."""
        raise NotImplementedError


class LeastLoaded(Policy):
    """Fewest in-flight requests, then fewest in-flight batches, then the longest since its last batch."""
    name = "least_loaded"

    def rank(self, free: list[Worker]) -> list[Worker]:
        return sorted(free, key=lambda w: (w.inflight_rows, w.inflight_batches, w.last_dispatch))


POLICIES: dict[str, type[Policy]] = {LeastLoaded.name: LeastLoaded}
DEFAULT = LeastLoaded.name


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
