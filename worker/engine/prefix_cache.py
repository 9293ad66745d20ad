"""A prefix cache across requests: the keys/values of whole prompt blocks, shared by every later row whose prompt
starts with the same blocks.

Exact where a block's keys/values depend on nothing after it: the block-causal families (LLaDA2.x, SDAR), whose
attention lets a position see its own block and the blocks before it only, and DiffusionGemma, whose prompt encoder
is causal (its entries: ``block`` tokens, every layer's keys/values). A block's entry is keyed by its whole
prefix (every token from position 0 to the block's end) and the block length (which shapes the attention inside a
block); entries form a radix tree of blocks (each entry's parent is the entry of the prefix one block shorter), walked
from the first block. LLaDA's and Dream's prompts are bidirectional (every prompt position sees the answer's
positions), so nothing there is reusable and the cache is not used (docs/engine.md, "Prefix cache").

Memory: at most ``budget`` bytes of keys and values; past it the least recently used entries go. Only leaves are
evicted, so a block goes before its ancestors (a lookup touches its chain deepest first, so a chain's blocks keep
the same order of recency). Recency is a counter, not a clock, so tensor-parallel ranks (each with the cache of its own kv
heads) make the same decisions."""
from __future__ import annotations

import functools
import hashlib
import heapq
from array import array
from dataclasses import dataclass



@functools.lru_cache(maxsize=64)
def _chain(data: bytes, block: int) -> tuple[bytes, ...]:
    """The chain keys of every whole block of ``data`` (token ids, 8 bytes each): PrefixCache.keys."""
    step = 8 * block
    out, h = [], hashlib.blake2b(block.to_bytes(8, "little"), digest_size=16)
    for j in range(len(data) // step):
        h.update(data[j * step:(j + 1) * step])
        out.append(h.copy().digest())
    return tuple(out)


@dataclass
class Entry:
    kv: tuple                # the block's keys/values: (k, v) [layers, kv_heads, block, head_dim] for the
                             # block-causal families; DiffusionGemma: every layer's k then every layer's v
    parent: bytes | None
    used: int
    children: int = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)


class PrefixCache:
    """``block``: the tokens of an entry for families whose prompts have no blocks of their own (DiffusionGemma's
    causal encoder); the block-causal families use each row's ``block_length``."""

    def __init__(self, budget_bytes: int, block: int = 16):
        self.budget = int(budget_bytes)
        self.block = block
        self.entries: dict[bytes, Entry] = {}
        self.bytes = 0
        self.clock = 0
        # eviction candidates, a heap of (used, key): pushed whenever an entry is a leaf with a new ``used`` (stored,
        # touched, or its last child evicted); an item whose entry is gone, has children or was touched since is
        # stale and skipped. The least recently used leaf without a scan of every entry (a full cache of 100,000
        # blocks took milliseconds an eviction)
        self._leaves: list[tuple[int, bytes]] = []
        # statistics: prompt tokens asked about, tokens served from the cache, blocks stored and evicted
        self.lookups = 0
        self.tokens_looked_up = 0
        self.tokens_hit = 0
        self.blocks_stored = 0
        self.blocks_evicted = 0

    @staticmethod
    def keys(tokens: list[int], block: int, blocks: int) -> tuple[bytes, ...]:
        """The chain keys of the first ``blocks`` blocks of ``tokens``: a running hash of the token ids (8 bytes
        each) and the block length, taken at every block's end. A request's prompt is asked about three times (the
        scheduler's admission, the lookup, the store): its whole chain is kept for the next asks
        (:func:`_chain`)."""
        return _chain(array("q", tokens).tobytes(), block)[:blocks]

    def lookup(self, tokens: list[int], block: int, limit: int) -> list[Entry]:
        """The cached entries of the longest run of the prompt's first (at most ``limit``) blocks, in order."""
        self.lookups += 1
        self.tokens_looked_up += limit * block
        found = []
        for key in self.keys(tokens, block, limit):
            e = self.entries.get(key)
            if e is None:
                break
            found.append((key, e))
        for key, e in reversed(found):     # deepest first: ancestors stay more recent than their descendants
            self._touch(key, e)
        self.tokens_hit += len(found) * block
        return [e for _, e in found]

    def _touch(self, key: bytes, e: Entry) -> None:
        self.clock += 1
        e.used = self.clock
        if e.children == 0:
            heapq.heappush(self._leaves, (e.used, key))
            if len(self._leaves) > 2 * len(self.entries) + 64:     # (a cache that stores nothing new evicts nothing:
                self._compact()                                    # its touches alone must not grow the heap)

    def _compact(self) -> None:
        """The heap rebuilt from the leaves alone (its stale items dropped)."""
        heap = self._leaves
        heap[:] = [(e.used, k) for k, e in self.entries.items() if e.children == 0]
        heapq.heapify(heap)

    def insert(self, tokens: list[int], block: int, first: int, blocks: int, kv) -> None:
        """Store blocks ``first`` .. ``blocks - 1`` of the prompt (``kv(j)`` gives block j's tensors, copied), whose
        earlier blocks are cached (or being stored now). Blocks already present are only touched."""
        if self.budget <= 0:
            return
        keys = self.keys(tokens, block, blocks)
        for j in range(blocks - 1, -1, -1):       # touched deepest first, as in lookup
            e = self.entries.get(keys[j])
            if e is not None:
                self._touch(keys[j], e)
        for j in range(first, blocks):
            if keys[j] in self.entries:
                continue
            parent = keys[j - 1] if j else None
            if parent is not None and parent not in self.entries:
                return                                    # its parent was evicted meanwhile: unreachable
            e = Entry(kv(j), parent, 0)                   # (views of the row's cache until there is room)
            if e.nbytes > self.budget:
                return
            self._make_room(e.nbytes, keep=parent)
            if self.bytes + e.nbytes > self.budget or (parent is not None and parent not in self.entries):
                return                                    # no room without evicting its own ancestors
            e.kv = tuple(t.clone() for t in e.kv)
            self.entries[keys[j]] = e
            self._touch(keys[j], e)
            self.bytes += e.nbytes
            self.blocks_stored += 1
            if parent is not None:
                self.entries[parent].children += 1

    def _make_room(self, need: int, keep: bytes | None) -> None:
        """Evict least recently used leaves (never ``keep``, the parent of what is being stored) until ``need``
        more bytes fit."""
        heap = self._leaves
        while self.bytes + need > self.budget and self.entries:
            kept = None
            while heap:
                used, key = heapq.heappop(heap)
                e = self.entries.get(key)
                if e is None or e.children or e.used != used:
                    continue                                  # stale
                if key == keep:
                    kept = (used, key)
                    continue
                break
            else:
                if kept is not None:
                    heapq.heappush(heap, kept)
                return                                        # no leaf but ``keep``
            if kept is not None:
                heapq.heappush(heap, kept)
            del self.entries[key]
            self.bytes -= e.nbytes
            self.blocks_evicted += 1
            parent = self.entries.get(e.parent) if e.parent is not None else None
            if parent is not None:
                parent.children -= 1
                if parent.children == 0:
                    heapq.heappush(heap, (parent.used, e.parent))

    def clear(self) -> None:
        """Drop every block (new weights: their keys/values are the old weights'); the statistics, counts since the
        start like the worker's other counters, go on."""
        self.entries.clear()
        self._leaves.clear()
        self.bytes = 0

    def has(self, key: bytes) -> bool:
        return key in self.entries

    def stats(self) -> dict:
        return {"budget_bytes": self.budget, "bytes": self.bytes, "blocks": len(self.entries),
                "lookups": self.lookups, "prompt_tokens_looked_up": self.tokens_looked_up,
                "cached_tokens": self.tokens_hit,
                "hit_rate": round(self.tokens_hit / self.tokens_looked_up, 4) if self.tokens_looked_up else 0.0,
                "blocks_stored": self.blocks_stored, "blocks_evicted": self.blocks_evicted}


class Admission:
    """One round of rows joining a batch (the worker's scheduler takes them; a bench's feed may too). A row whose
    first uncached reusable prompt block is the first uncached block of a row taken earlier in the same round
    waits one round: by then that row's first forward has stored its prompt blocks, and the waiting row reuses them
    instead of computing them in the same forward (a forward is as wide as its widest row, so computing them
    alongside would save nothing). So requests sharing a prefix (few-shot prompts, the ``n`` choices of a request,
    rollouts of one prompt) compute it once. A row waits once at most (``waited``: the caller's record of that), so a
    block that never lands in the cache (over the budget, its row cancelled) costs the others one round, not one
    round each. The first uncached block, not the first block: a head that many prompts share (a chat template, a
    system prompt) is cached after the first request, and the rows that share more than that head still compute the
    rest once."""

    def __init__(self, engine):
        self.engine = engine
        self.keys: set[bytes] = set()

    def key(self, prompt_ids: list[int], plan) -> tuple[bytes, ...] | None:
        """The cache keys of the blocks a row of ``plan`` would reuse, in order (a row's, computed once); None where
        it would reuse none."""
        from . import algorithms
        pc = self.engine.prefix_cache
        alg = algorithms.REGISTRY.get(plan.params.algorithm)
        if pc is None or alg is None or alg.prefix_blocks is None:
            return None
        unit, blocks = alg.prefix_blocks(plan, pc)
        return PrefixCache.keys(prompt_ids, unit, blocks) if blocks >= 1 else None

    def missing(self, chain: tuple[bytes, ...] | None) -> bytes | None:
        """The key of the first block of ``chain`` (:meth:`key`) not in the cache now; None where all are."""
        pc = self.engine.prefix_cache
        for k in chain or ():
            if not pc.has(k):
                return k
        return None

    def waits(self, chain: tuple[bytes, ...] | None, waited: bool = False) -> bool:
        """Whether the row of ``chain`` (:meth:`key`) waits a round; ``waited``: it waited once already (it does not
        again)."""
        if waited or not chain:
            return False
        k = self.missing(chain)
        return k is not None and k in self.keys

    def take(self, chain: tuple[bytes, ...] | None) -> None:
        """A row of ``chain`` is taken this round."""
        k = self.missing(chain)
        if k is not None:
            self.keys.add(k)
