"""Weights gathered just in time (``shard="full"``, ZeRO-3): during a fit each replica keeps only its
own trainable variables' weights, and every layer gathers the others' for its forward and its
backward, then frees them.

Each layer with sharded weights of its own has its ``call`` shadowed on the instance (as the
BatchNormalization sync does): before Keras's call the layer's weights are broadcast from their
owners, after it the other replicas' copies are freed. A variable split along dimension 0
(``_step.owners.pieces_of``) is put together from every replica's rows, and each keeps its own rows
only after. Autograd keeps the ``Parameter``, not its
storage, so backward needs them again: a hook on the layer's outputs gathers them before autograd
runs the layer's backward, and each weight is freed once its gradient is accumulated (its sum goes
to its owner, ``_step.buckets``). Every replica runs the same layers in the same order, and a
layer's state (gathered or not) moves alike on all, so their broadcasts match.

Prefetch (FSDP2's), opt-in: ``TORCH_DP_PREFETCH=1`` in the caller's environment (every replica takes
rank 0's choice as the fit starts). As a layer's forward begins, the gather of the layer called after it
is started, and as its backward begins, that of the layer called before it, each an asynchronous
broadcast that goes on while the layer computes; the layer that needs it waits for it then. The order is
the calls', as FSDP2 records it: backward takes the layer each call followed (known at the call), forward
the layer that followed it in an earlier pass (so the first pass prefetches in backward only). The
model's layer order is no guide: keras-hub's GPT-2 lists its layers nearly in reverse of their calls,
and prefetching by it gathered, in each forward, a layer already called, whose weights were then held
until its backward, all of them by the forward's end. (With the calls' order the 126 M GPT-2 trains at
the peaks it has without prefetch; rank 0's excess in some runs' resumed job comes without prefetch
too: docs/sharding.md.) A layer already called in this pass is not prefetched in forward, nor one whose
backward ended; a guess that still misses (a layer called at two places) holds one layer until it is
called or the step ends. Every replica guesses alike, so the broadcasts match. ``most_held`` is the
most bytes of other replicas' weights held at once. Off by default: on CPU it cut the waits but bought
no speed (benchmarks/prefetch_torch.py).

A weight is freed by swapping its tensor's data for an empty one, as a freed optimizer slot is
(``_step.owners``); Keras keeps the shape apart. Not sharded: a variable with a regularizer (Keras
reads it after the forward pass, for the loss), kept whole on every replica and shared after each
update as under ``shard="gradients"``.

torch's own ``fully_shard`` (FSDP2) is not used: it swaps a module's registered parameters for
DTensors, while a Keras layer reads each weight through its ``keras.Variable``, which keeps the
original tensor.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, final

import keras
import torch
import torch.distributed as dist

from dp_core.keras import internals
from torch_dp._comm.collectives import _entering
from torch_dp._comm.replica import Replica
from torch_dp._step.owners import Held, Piece, dtype_of, held_numel, pieces_of_flat, release


class _Gathering(NamedTuple):
    """One layer's gather under way: its broadcasts, and what puts the weights in place once they are done."""

    works: list[Any]
    finish: Callable[[], None]
    started: float  # when its broadcasts were started
    nbytes: int  # the other replicas' weights it brings, held until its layer frees them


@dataclass
class _Pass:
    """One forward pass's layers (by id, but ``last``: an index in ``JustInTime``'s layers) and its backward's."""

    last: int | None = None  # the layer called last
    called: set[int] = field(default_factory=set)  # called and freed in forward: wanted again in backward only
    finished: set[int] = field(default_factory=set)  # whose backward ended


def shardable(variable: keras.Variable) -> bool:
    """Whether a trainable variable's weights can be freed between its layer's calls."""
    return getattr(variable, "regularizer", None) is None


@final
class JustInTime:
    """The model's layers, each gathering its own sharded weights around its calls."""

    def __init__(
        self, model: keras.Model, variables: Sequence[keras.Variable], pieces: Sequence[Piece], replica: Replica
    ) -> None:
        self.rank, self.device, self.group = replica.rank, replica.device, replica.group
        self._pieces: dict[int, list[Piece]] = {}  # each shardable variable's: one whole, or one per replica
        for piece in pieces:
            if shardable(variables[piece.variable]):
                self._pieces.setdefault(id(variables[piece.variable]), []).append(piece)
        self._layers: list[tuple[keras.layers.Layer, list[keras.Variable]]] = []
        claimed: set[int] = set()  # a weight shared by two layers is gathered by the first
        for layer in internals.flatten_layers(model, include_self=True):
            own = [
                v for v in internals.own_trainable_variables(layer) if id(v) in self._pieces and id(v) not in claimed
            ]
            claimed.update(id(v) for v in own)
            if own:
                self._layers.append((layer, own))
        self.sharded = [v for v in variables if id(v) in claimed]
        self._index = {id(layer): i for i, (layer, _) in enumerate(self._layers)}
        self._pending: dict[int, _Gathering] = {}  # layer id -> its gather started ahead (prefetch)
        self.prefetch = False  # rank 0's choice, taken by every replica at ``install``
        self._next: dict[int, int] = {}  # layer index -> the index of the layer called after it (first seen)
        self._pass = _Pass()  # this forward pass's calls, and the backward that follows it
        self._held: dict[int, int] = {}  # layer id -> bytes of other replicas' weights it holds or gathers
        self.most_held = 0  # the most bytes of other replicas' weights held at once (gathered or on the way)
        self._gathered: dict[int, set[int]] = {}  # layer id -> its weights still waiting for a gradient
        self._rows: dict[int, torch.Tensor] = {}  # a split variable's own rows while it is gathered whole
        self._undo: list[Callable[[], None]] = []
        self._model = model
        self.paused = False  # rank 0 holds every weight (a callback runs on it alone): no gathers
        self.seconds = 0.0  # spent gathering since the last ``take_seconds`` (the scaling report's)
        self.ahead = 0.0  # the gathers' time in flight before their layer needed them, since then

    @contextlib.contextmanager
    def pausing(self) -> Iterator[None]:
        """Within the block no layer gathers (rank 0 runs a callback alone, reading what it is served)."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def install(self) -> None:
        """Each layer's ``call`` shadowed; each weight freed once its gradient is accumulated; whether to
        prefetch, as rank 0's environment says (a replica that guessed otherwise would mismatch the broadcasts)."""
        chosen = float(os.environ.get("TORCH_DP_PREFETCH") == "1")
        flag = torch.tensor([chosen], device=self.device)
        _entering()
        dist.broadcast(flag, src=0, group=self.group)
        self.prefetch = bool(flag.item())
        for layer, own in self._layers:
            self._undo.append(internals.override(layer, "call", self._call(layer, own, layer.call)))
            for variable in own:
                handle = internals.stored_value(variable).register_post_accumulate_grad_hook(
                    self._on_gradient(layer, own, variable)
                )
                self._undo.append(handle.remove)
        self._undo.append(internals.override(self._model, "call", self._new_pass(self._model.call)))
        self.free_all()

    def uninstall(self) -> None:
        self.free_all()  # a step left undone (preempted, stopped) may leave a layer gathered
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        self._gathered = {}

    def free_all(self) -> None:
        """Every other replica's weights freed (after a step, where some got no gradient), and the gathers
        started ahead for layers that were not called waited for and dropped."""
        for gathering in self._pending.values():
            for work in gathering.works:
                work.wait()
        self._pending = {}
        for variable in self.sharded:
            self._release(variable)
        self._gathered, self._held = {}, {}

    def take_seconds(self) -> tuple[float, float]:
        """The seconds spent waiting for gathers, and those their broadcasts were in flight before their
        layer needed them, since the last call."""
        taken = (self.seconds, self.ahead)
        self.seconds = self.ahead = 0.0
        return taken

    def owned(self, owner: int) -> list[Held]:
        """What ``owner`` holds of the sharded weights: its whole variables and its rows of the split ones."""
        return [Held(v, p.rows) for v in self.sharded for p in self._pieces[id(v)] if p.owner == owner]

    def _new_pass(self, keras_call: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self._pass = _Pass()
            return keras_call(*args, **kwargs)

        return call

    def _call(self, layer: keras.layers.Layer, own: list[keras.Variable], keras_call: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.paused or id(layer) in self._gathered:  # called again inside its own call, or in backward
                return keras_call(*args, **kwargs)
            index, before = self._index[id(layer)], self._pass.last
            if before is not None:
                self._next.setdefault(before, index)
            self._pass.last = index
            self._gather(layer, own)
            self._prefetch(self._next.get(index), skip=self._pass.called)
            try:
                outputs = keras_call(*args, **kwargs)
            finally:
                self._free(layer, own)
                self._pass.called.add(id(layer))
            if torch.is_grad_enabled():
                for output in keras.tree.flatten(outputs):
                    if isinstance(output, torch.Tensor) and output.requires_grad:
                        output.register_hook(self._before_backward(layer, own, before))
            return outputs

        return call

    def _before_backward(
        self, layer: keras.layers.Layer, own: list[keras.Variable], before: int | None
    ) -> Callable[[torch.Tensor], None]:
        """The layer gathered as its backward begins, and the gather of ``before`` (the layer called before
        this call) started."""

        def hook(_: torch.Tensor) -> None:
            if id(layer) not in self._gathered:
                self._gather(layer, own)
                self._gathered[id(layer)] = {id(v) for v in own if internals.stored_value(v).requires_grad}
            self._prefetch(before, skip=self._pass.finished)

        return hook

    def _on_gradient(
        self, layer: keras.layers.Layer, own: list[keras.Variable], variable: keras.Variable
    ) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            waiting = self._gathered.get(id(layer))
            if waiting is None:
                return
            waiting.discard(id(variable))
            if not waiting:
                self._free(layer, own)
                self._pass.finished.add(id(layer))

        return hook

    def _prefetch(self, index: int | None, *, skip: set[int]) -> None:
        """The gather of the layer at ``index`` started, unless it holds its weights, is on its way, or is in
        ``skip`` (called already in this forward pass; its backward ended)."""
        if not self.prefetch or index is None:
            return
        following, own = self._layers[index]
        if id(following) not in self._gathered and id(following) not in self._pending and id(following) not in skip:
            self._pending[id(following)] = self._start(own)
            self._hold(following, self._pending[id(following)].nbytes)

    def _hold(self, layer: keras.layers.Layer, nbytes: int) -> None:
        self._held[id(layer)] = nbytes
        self.most_held = max(self.most_held, sum(self._held.values()))

    def _gather(self, layer: keras.layers.Layer, own: list[keras.Variable]) -> None:
        """The layer's weights in place: its gather started ahead, or started now, waited for."""
        started = time.perf_counter()
        gathering = self._pending.pop(id(layer), None)
        if gathering is not None:
            self.ahead += started - gathering.started
        else:
            gathering = self._start(own)
        for work in gathering.works:
            work.wait()
        gathering.finish()
        self._gathered[id(layer)] = set()
        self._hold(layer, gathering.nbytes)
        self.seconds += time.perf_counter() - started

    def _start(self, own: list[keras.Variable]) -> _Gathering:
        """The layer's weights broadcast from their owners (one broadcast per owner and dtype, in flight
        when this returns), a split one's rows from each replica into its whole."""
        groups: dict[tuple[int, torch.dtype], list[Held]] = {}
        wholes: dict[int, torch.Tensor] = {}
        for variable in own:
            for piece in self._pieces[id(variable)]:
                groups.setdefault((piece.owner, dtype_of(variable)), []).append(Held(variable, piece.rows))
            if len(self._pieces[id(variable)]) > 1:
                rows = internals.stored_value(variable).data
                wholes[id(variable)] = torch.empty(tuple(variable.shape), dtype=rows.dtype, device=self.device)
        flats, works, started = [], [], time.perf_counter()
        for (owner, dtype), group in groups.items():
            if owner == self.rank:
                flat = torch.cat([internals.stored_value(h.variable).detach().reshape(-1) for h in group])
            else:
                flat = torch.empty(sum(held_numel(h) for h in group), dtype=dtype, device=self.device)
            _entering()
            works.append(dist.broadcast(flat, src=owner, group=self.group, async_op=True))
            flats.append((owner, group, flat))

        def finish() -> None:
            for owner, group, flat in flats:
                for held, piece in zip(group, pieces_of_flat(group, flat), strict=True):
                    if held.rows is not None:
                        wholes[id(held.variable)][held.rows[0] : held.rows[1]] = piece
                    elif owner != self.rank:
                        internals.stored_value(held.variable).data = piece
            for variable in own:
                if id(variable) in wholes:
                    self._rows[id(variable)] = internals.stored_value(variable).data
                    internals.stored_value(variable).data = wholes[id(variable)]

        received = sum(flat.numel() * flat.element_size() for owner, _, flat in flats if owner != self.rank)
        return _Gathering(works, finish, started, received + sum(w.numel() * w.element_size() for w in wholes.values()))

    def _free(self, layer: keras.layers.Layer, own: list[keras.Variable]) -> None:
        for variable in own:
            self._release(variable)
        self._gathered.pop(id(layer), None)
        self._held.pop(id(layer), None)

    def _release(self, variable: keras.Variable) -> None:
        """Another owner's whole variable freed; a split one back to its own rows (kept while gathered)."""
        pieces = self._pieces[id(variable)]
        if len(pieces) > 1:
            if id(variable) in self._rows:
                internals.stored_value(variable).data = self._rows.pop(id(variable))
        elif pieces[0].owner != self.rank:
            release(variable)
