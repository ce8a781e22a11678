"""Gradients summed in buckets during the backward pass, as DDP sums them.

Each bucket's all-reduce is started asynchronously from ``register_post_accumulate_grad_hook`` as
soon as all its gradients exist, while backward computes the rest. Variables go in reverse order,
roughly the order backward produces their gradients, one dtype per bucket; as in DDP the first
bucket holds at most ``FIRST_BUCKET_BYTES`` (1 MiB), so the first all-reduce starts early, the others
``BUCKET_BYTES`` (25 MiB). Buckets start strictly in index order (a ready bucket waits for the ones
before it) and those whose variables got no gradient start after backward with zeros, so every
replica issues the same collectives in the same order. The sums are the same sums.

The step's few other values to sum (the loss, a preemption flag, the metric states and rank 0's
decisions when a callback acts at every batch: ``_step.steps``) ride in the last bucket, which
backward fills last: a step sums in as many all-reduces as it has buckets, all but the last
overlapped with backward. A model whose gradients fit in one bucket (1 MiB) has nothing to overlap:
it sums everything in one all-reduce after backward, synchronously.

Only ``train_step`` asks for them: a gradient-accumulation step that is not the last of its
window (``_step.accumulation``) runs backward without buckets and sends nothing.

With ``shard=`` (``_step.shards``) each bucket holds one owner's pieces (whole variables, or its rows
of a variable split along dimension 0: ``_step.owners.Piece``) and is summed onto that owner alone,
whatever the gradients' size: every other replica sends its copy straight to the owner, which adds
them up in rank order (point to point: gloo's ``reduce`` runs a ring, moving as many bytes as an
all-reduce, where a sum onto one replica needs each other one to send its copy once); a split
variable's pieces, one bucket per owner, make a reduce-scatter. With ``"gradients"`` and ``"full"``
every replica then frees a variable's own gradient once all its pieces are sent (the owner's copy is
in its bucket), so it keeps only the sums of its own pieces (``freed`` says which variables had a
gradient); with ``"optimizer"`` it keeps its own copies, as ZeRO-1 does. The step's other values then
travel in a small all-reduce of their own.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, final

import keras
import torch
import torch.distributed as dist

from torch_dp._comm.collectives import _entering
from torch_dp._comm.replica import Replica
from torch_dp._step.owners import Piece, Rows, numel, rows_shape

FIRST_BUCKET_BYTES = 2**20  # DDP's first bucket (its _DEFAULT_FIRST_BUCKET_BYTES)
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
# Buckets whose messages may be in flight at once during backward: launching one waits for the one
# this many before it, so a replica holds a few buckets' copies, not every gradient's (under shard=,
# each replica's copies of the others' pieces and the copies it receives of its own)
IN_FLIGHT = 2


def _bytes(variable: keras.Variable) -> int:
    return numel(variable) * variable.value.element_size()


@final
class GradientBuckets:
    """The buckets of one model's trainable variables (indices into ``trainable_weights``)."""

    def __init__(
        self,
        variables: Sequence[keras.Variable],
        *,
        pieces: Sequence[Piece] | None = None,
        rank: int = 0,
        num_replicas: int = 1,
        keep_sent: bool = False,
    ) -> None:
        """``pieces``: what each replica owns of the variables, and alone gets the sum of (``rank`` is
        this one's, of ``num_replicas``; ``keep_sent``: gradients are kept once sent); None: every
        replica gets every sum."""
        by_variable: list[list[tuple[Rows | None, int | None]]] = [[(None, None)] for _ in variables]
        if pieces is not None:
            by_variable = [[] for _ in variables]
            for piece in pieces:
                by_variable[piece.variable].append((piece.rows, piece.owner))
        self.buckets: list[list[tuple[int, Rows | None]]] = []  # each bucket's variables (and rows, where split)
        self.destinations: list[int | None] = []
        size, dtype = 0, None
        for index in reversed(range(len(variables))):
            value = variables[index].value
            for rows, owner in by_variable[index]:
                cap = FIRST_BUCKET_BYTES if len(self.buckets) <= 1 else BUCKET_BYTES
                nbytes = _numel(rows_shape(variables[index].shape, rows)) * value.element_size()
                if not self.buckets or size + nbytes > cap or value.dtype != dtype or owner != self.destinations[-1]:
                    self.buckets.append([])
                    self.destinations.append(owner)
                    size, dtype = 0, value.dtype
                self.buckets[-1].append((index, rows))
                size += nbytes
        self._last_bucket = {index: b for b, bucket in enumerate(self.buckets) for index, _ in bucket}
        self.rank, self.num_replicas, self.keep_sent = rank, num_replicas, keep_sent
        self._variables = [(id(v), tuple(v.shape)) for v in variables]
        self._launched: list[tuple[torch.Tensor | None, list[Any], list[torch.Tensor]]] = []
        self._extras: list[torch.Tensor] = []  # the step's other values, in the last bucket
        self._group: dist.ProcessGroup | None = None  # the replicas' group, given by each ``reducing``
        self.overlapped = 0.0  # the last backward's seconds with an all-reduce in flight
        self.freed: set[int] = set()  # the variables whose gradient the last backward freed once sent

    def serves(self, variables: Sequence[keras.Variable]) -> bool:
        return [(id(v), tuple(v.shape)) for v in variables] == self._variables

    @contextlib.contextmanager
    def reducing(
        self,
        variables: Sequence[keras.Variable],
        extras: Sequence[torch.Tensor] = (),
        group: dist.ProcessGroup | None = None,
    ) -> Iterator[None]:
        """Around ``backward``: each bucket's all-reduce (over ``group``, the replicas') starts once
        its gradients exist; ``extras`` (float32, summed over replicas) ride in the last one when it
        is all-reduced in float32 (``summed`` says whether they did)."""
        self._group = group
        values = [v.value for v in variables]
        last = len(self.buckets) - 1
        rides = last >= 0 and self.destinations[last] is None
        rides = rides and all(values[i].dtype == torch.float32 for i, _ in self.buckets[last])
        rides = rides and all(extra.dtype == torch.float32 for extra in extras)
        self._extras = list(extras) if rides else []
        shapes = [tuple(v.shape) for v in variables]  # a weight freed under shard="full" keeps its Keras shape
        buckets_of: dict[int, list[int]] = {}
        for b, bucket in enumerate(self.buckets):
            for index, _ in bucket:
                buckets_of.setdefault(index, []).append(b)
        ready = [0] * len(self.buckets)
        self._launched = []
        self.freed = set()
        first_launch: list[float] = []

        def launch_ready() -> None:
            while len(self._launched) < len(self.buckets):
                b = len(self._launched)
                if ready[b] < len(self.buckets[b]):
                    return
                if not first_launch:
                    first_launch.append(time.perf_counter())
                self._launch(values, shapes, b)
                if b >= IN_FLIGHT:  # an older bucket's messages done: its copies go (an owner keeps its sum)
                    self._settle(b - IN_FLIGHT)

        def on_gradient(index: int) -> Any:
            def hook(_: torch.Tensor) -> None:
                for b in buckets_of[index]:
                    ready[b] += 1
                launch_ready()

            return hook

        handles = [value.register_post_accumulate_grad_hook(on_gradient(i)) for i, value in enumerate(values)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        self.overlapped = time.perf_counter() - first_launch[0] if first_launch else 0.0

    def _launch(self, values: Sequence[torch.Tensor], shapes: Sequence[tuple[int, ...]], b: int) -> None:
        parts = [_rows(_gradient_or_zeros(values[i], shapes[i]), rows).reshape(-1) for i, rows in self.buckets[b]]
        tail = [extra.reshape(-1) for extra in self._extras] if b == len(self.buckets) - 1 else []
        flat = torch.cat([*parts, *tail])
        _entering()
        destination = self.destinations[b]
        if destination is None:
            self._launched.append(
                (flat, [dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._group, async_op=True)], [])
            )
            return
        if destination == self.rank:  # every other replica's copy, to add to this one's
            others = [torch.empty_like(flat) for _ in range(self.num_replicas - 1)]
            sources = [r for r in range(self.num_replicas) if r != self.rank]
            received = [dist.irecv(copy, src=r, group=self._group) for copy, r in zip(others, sources, strict=True)]
            self._launched.append((flat, received, others))
        else:
            self._launched.append((flat, [dist.isend(flat, dst=destination, group=self._group)], []))
        if not self.keep_sent:  # every piece sent (this replica's own copied into its bucket): the gradient goes
            for i, _ in self.buckets[b]:
                if self._last_bucket[i] == b and values[i].grad is not None:
                    values[i].grad = None
                    self.freed.add(i)

    def summed(self, variables: Sequence[keras.Variable]) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """After ``backward`` in ``reducing``: the remaining buckets started (zeros for variables
        without a gradient), every one waited for; each variable's summed gradient (None for
        another replica's, with pieces; this replica's rows of a split one), and the extras' sums
        (None: they did not ride along)."""
        values = [v.value for v in variables]
        shapes = [tuple(v.shape) for v in variables]
        while len(self._launched) < len(self.buckets):
            self._launch(values, shapes, len(self._launched))
        summed: list[Any] = [None] * len(values)
        extras, self._extras = self._extras, []
        summed_extras: list[torch.Tensor] | None = None
        for b in range(len(self.buckets)):
            self._settle(b)
        for b, (bucket, (flat, _, _)) in enumerate(zip(self.buckets, self._launched, strict=True)):
            if flat is None:  # another replica's pieces: sent
                continue
            tail = extras if b == len(self.buckets) - 1 else []
            bucket_shapes = [rows_shape(shapes[i], rows) for i, rows in bucket]
            pieces = torch.split(flat, [_numel(shape) for shape in bucket_shapes] + [extra.numel() for extra in tail])
            for (index, _), shape, piece in zip(bucket, bucket_shapes, pieces[: len(bucket)], strict=True):
                summed[index] = piece.view(shape)
            if tail:
                summed_extras = [p.view(extra.shape) for p, extra in zip(pieces[len(bucket) :], tail, strict=True)]
        self._launched = []
        return summed, summed_extras

    def _settle(self, b: int) -> None:
        """Bucket ``b``'s messages waited for: a bucket sent to another replica lets its copy go, an
        owner's holds the sum of every replica's copy (added in rank order, the same sum on any owner)."""
        flat, works, others = self._launched[b]
        if not works and not others:
            return  # settled before
        for work in works:
            work.wait()
        destination = self.destinations[b]
        if destination is not None and destination != self.rank:
            self._launched[b] = (None, [], [])
            return
        if others and flat is not None:
            flat = summed_in_rank_order([*others[: self.rank], flat, *others[self.rank :]])
        self._launched[b] = (flat, [], [])


def summed_in_rank_order(copies: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every replica's copy of one bucket, in rank order, added into the first in place: the same sum on any
    owner, with no other bucket made (a stack of the copies and its sum held N + 1 buckets more at once)."""
    total = copies[0]
    for copy in copies[1:]:
        total.add_(copy)
    return total


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _rows(gradient: torch.Tensor, rows: Rows | None) -> torch.Tensor:
    return gradient if rows is None else gradient[rows[0] : rows[1]]


def _gradient_or_zeros(value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    # zeros keep a bucket the same size on every replica, as in the one all-reduce after backward
    return torch.zeros(shape, dtype=value.dtype, device=value.device) if value.grad is None else value.grad.detach()


_by_model: weakref.WeakKeyDictionary[keras.Model, GradientBuckets] = weakref.WeakKeyDictionary()


def gradient_buckets(model: keras.Model, replica: Replica) -> GradientBuckets | None:
    """The model's buckets on several replicas when its gradients fill more than one, else None (one
    all-reduce after backward, which is what one bucket would be: backward's last gradient starts it);
    kept per model while its variables keep their shapes."""
    variables = model.trainable_weights
    if not replica.distributed or sum(_bytes(v) for v in variables) <= FIRST_BUCKET_BYTES:
        return None
    buckets = _by_model.get(model)
    if buckets is None or not buckets.serves(variables):
        buckets = _by_model[model] = GradientBuckets(variables)
    return buckets
