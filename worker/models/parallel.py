"""Tensor and expert parallelism inside one model: the shards a rank holds and the collectives that join them.

A worker of ``--tensor-parallel-size N`` is N ranks of one torch.distributed group (worker/ranks.py starts them).
Every rank builds the same model with its own shard of the weights (Megatron's layout):

- attention: the query heads split evenly; the kv heads too, or, where there are fewer kv heads than ranks, each rank
  holds the one kv head its query heads read (replicated); ``o_proj`` takes the matching input columns;
- dense MLPs (and shared experts): ``gate``/``up`` split by output rows (column-parallel), ``down`` by input
  columns (row-parallel); one all-reduce after ``o_proj`` and one after the MLP: one per half block;
- MoE experts: whole experts split over the ranks (expert parallelism); the router is replicated, so every rank
  makes the same choice; a rank runs its experts on the tokens routed to them, and the sum joins the MLP's all-reduce;
- the vocabulary: embedding and LM head split by vocabulary rows when the vocabulary divides evenly (the lookup is
  masked and all-reduced, the logits all-gathered once per call), else replicated;
- norms, routers, RoPE tables: replicated. Each rank's KV cache holds its own kv heads.

A row-parallel sum runs in a different order from the one-rank matmul, so logits differ in the last bits; the
decoded tokens and nfe are the one-rank model's (tests/test_tensor_parallel.py checks every family's goldens).

Model code asks :func:`current` for the layout while it is being built (``load_model`` sets it with
:func:`building`); each sharded parameter carries a :class:`Shard` (``mark``) telling the loader which slices of
the checkpoint tensor it holds (worker/models/checkpoint.py reads only those)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from .checkpoint import CheckpointError


@dataclass(frozen=True)
class Shard:
    """A parameter holding the slices ``ranges`` ((start, length), concatenated) of dimension ``dim`` of a checkpoint
    tensor whose dimension ``dim`` is ``full`` long."""
    dim: int
    full: int
    ranges: tuple[tuple[int, int], ...]


def mark(p: nn.Parameter | None, dim: int, full: int, ranges) -> None:
    if p is not None:
        p.shard = Shard(dim, full, tuple(ranges))


def chunk(n: int, index: int, count: int) -> tuple[int, int]:
    """(start, length) of chunk ``index`` of ``count`` equal chunks of ``n``."""
    return index * (n // count), n // count


@dataclass(frozen=True)
class Layout:
    """One rank's place in its worker: ``rank`` of ``size`` in the process ``group`` (None: the default group)."""
    rank: int = 0
    size: int = 1
    group: object = None

    @property
    def parallel(self) -> bool:
        return self.size > 1

    def split(self, n: int, what: str) -> int:
        """This rank's share of ``n`` (heads, intermediate channels, experts); an uneven split is an error."""
        if n % self.size:
            raise CheckpointError(f"{what}: {n} cannot be split evenly over --tensor-parallel-size {self.size}")
        return n // self.size

    def heads(self, n: int, what: str = "attention heads") -> tuple[int, int]:
        """(local heads, index of the first): an even split."""
        local = self.split(n, what)
        return local, self.rank * local

    def kv_heads(self, kv: int, heads: int) -> tuple[int, int]:
        """(local kv heads, index of the first) for ``kv`` kv heads serving ``heads`` query heads: an even split, or
        with fewer kv heads than ranks the one kv head this rank's query heads read."""
        self.split(heads, "attention heads")
        if kv >= self.size:
            return self.heads(kv, "key/value heads")
        if self.size % kv:
            raise CheckpointError(f"key/value heads: {kv} neither divide nor are divided by "
                                  f"--tensor-parallel-size {self.size}")
        return 1, self.rank * kv // self.size

    def vocab(self, n: int) -> tuple[int, int]:
        """(local rows, first row) of an embedding or head of ``n`` rows: split when even, else whole."""
        if self.size == 1 or n % self.size:
            return n, 0
        return n // self.size, self.rank * (n // self.size)

    # ------------------------------------------------------------ collectives (no-ops on one rank)
    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension (rank order)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    # ------------------------------------------------------------ marking a module's parameters
    def column(self, linear: nn.Linear, full: int, ranges) -> None:
        """``linear`` holds output rows ``ranges`` of ``full`` (its bias the same entries)."""
        mark(linear.weight, 0, full, ranges)
        mark(linear.bias, 0, full, ranges)

    def row(self, linear: nn.Linear, full: int, ranges) -> None:
        """``linear`` holds input columns ``ranges`` of ``full`` (its bias, if any, is whole: :func:`row_linear`)."""
        mark(linear.weight, 1, full, ranges)


_CURRENT = Layout()


def current() -> Layout:
    """The layout of the model being built (one rank unless :func:`building` says otherwise)."""
    return _CURRENT


@contextlib.contextmanager
def building(layout: Layout | None):
    global _CURRENT
    was, _CURRENT = _CURRENT, layout or Layout()
    try:
        yield
    finally:
        _CURRENT = was


# ---------------------------------------------------------------- building blocks
def swiglu_shards(tp: Layout, gate: nn.Linear, up: nn.Linear, down: nn.Linear, full: int) -> None:
    """Mark an MLP of ``full`` intermediate channels built with ``full // size`` of them on this rank."""
    r = [chunk(full, tp.rank, tp.size)]
    tp.column(gate, full, r)
    tp.column(up, full, r)
    tp.row(down, full, r)


def attention_projections(hidden: int, heads: int, kv: int, head_dim: int, qkv_bias: bool = False,
                          o_bias: bool = False, values: bool = True):
    """This rank's q/k/v/o projections of an attention with ``heads`` query and ``kv`` kv heads, marked for the
    loader: ``(q, k, v, o, local heads, local kv heads)`` (``v`` None without ``values``)."""
    tp = current()
    hq, hk = tp.heads(heads)[0], tp.kv_heads(kv, heads)[0]
    q = nn.Linear(hidden, hq * head_dim, bias=qkv_bias)
    k = nn.Linear(hidden, hk * head_dim, bias=qkv_bias)
    v = nn.Linear(hidden, hk * head_dim, bias=qkv_bias) if values else None
    o = nn.Linear(hq * head_dim, hidden, bias=o_bias)
    if tp.parallel:
        (h0, k0) = tp.heads(heads)[1], tp.kv_heads(kv, heads)[1]
        tp.column(q, heads * head_dim, [(h0 * head_dim, hq * head_dim)])
        for p in (k, v):
            if p is not None:
                tp.column(p, kv * head_dim, [(k0 * head_dim, hk * head_dim)])
        tp.row(o, heads * head_dim, [(h0 * head_dim, hq * head_dim)])
    return q, k, v, o, hq, hk


def row_linear(tp: Layout, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """A row-parallel projection: the partial products summed over the ranks, then the (whole) bias once."""
    if not tp.parallel:
        return linear(x)
    y = tp.reduce(torch.nn.functional.linear(x, linear.weight))
    return y if linear.bias is None else y + linear.bias


class VocabEmbedding(nn.Embedding):
    """``nn.Embedding`` whose rows may be split over the ranks: a rank looks up the ids in its rows, zeros elsewhere,
    and the ranks' lookups are summed (exact: one of them is non-zero)."""

    def __init__(self, vocab: int, hidden: int):
        tp = current()
        local, self.first = tp.vocab(vocab)
        super().__init__(local, hidden)
        self.tp, self.full = tp, vocab
        if local != vocab:
            mark(self.weight, 0, vocab, [(self.first, local)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.num_embeddings == self.full:
            return super().forward(ids)
        local = ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        x = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.reduce(x.masked_fill(outside.unsqueeze(-1), 0))


def head(hidden: int, vocab: int) -> nn.Linear:
    """An untied LM head of ``vocab`` rows: this rank's rows of it (:meth:`Layout.vocab`)."""
    tp = current()
    local, first = tp.vocab(vocab)
    lin = nn.Linear(hidden, local, bias=False)
    if local != vocab:
        tp.column(lin, vocab, [(first, local)])
    return lin


def vocab_logits(tp: Layout, h: torch.Tensor, weight: torch.Tensor, vocab: int) -> torch.Tensor:
    """``h @ weight.T`` for a head or tied embedding of ``vocab`` rows, gathered when it is split."""
    y = torch.nn.functional.linear(h, weight)
    return tp.gather(y) if weight.shape[0] != vocab else y
