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

A weight is freed by swapping its tensor's data for an empty one, as a freed optimizer slot is
(``_step.owners``); Keras keeps the shape apart. Not sharded: a variable with a regularizer (Keras
reads it after the forward pass, for the loss), kept whole on every replica and shared after each
update as under ``shard="gradients"``.

torch's own ``fully_shard`` (FSDP2) is not used: it swaps a module's registered parameters for
DTensors, while a Keras layer reads each weight through its ``keras.Variable``, which keeps the
original tensor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, final

import keras
import torch
import torch.distributed as dist

from dp_core.keras import internals
from torch_dp._comm.collectives import _entering
from torch_dp._comm.replica import Replica
from torch_dp._step.owners import Held, Piece, dtype_of, held_numel, pieces_of_flat, release


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
        self._gathered: dict[int, set[int]] = {}  # layer id -> its weights still waiting for a gradient
        self._rows: dict[int, torch.Tensor] = {}  # a split variable's own rows while it is gathered whole
        self._undo: list[Callable[[], None]] = []
        self.paused = False  # rank 0 holds every weight (a callback runs on it alone): no gathers
        self.seconds = 0.0  # spent gathering since the last ``take_seconds`` (the scaling report's)

    def install(self) -> None:
        """Each layer's ``call`` shadowed; each weight freed once its gradient is accumulated."""
        for layer, own in self._layers:
            self._undo.append(internals.override(layer, "call", self._call(layer, own, layer.call)))
            for variable in own:
                handle = internals.stored_value(variable).register_post_accumulate_grad_hook(
                    self._on_gradient(layer, own, variable)
                )
                self._undo.append(handle.remove)
        self.free_all()

    def uninstall(self) -> None:
        self.free_all()  # a step left undone (preempted, stopped) may leave a layer gathered
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        self._gathered = {}

    def free_all(self) -> None:
        """Every other replica's weights freed (after a step, where some got no gradient)."""
        for variable in self.sharded:
            self._release(variable)
        self._gathered = {}

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def owned(self, owner: int) -> list[Held]:
        """What ``owner`` holds of the sharded weights: its whole variables and its rows of the split ones."""
        return [Held(v, p.rows) for v in self.sharded for p in self._pieces[id(v)] if p.owner == owner]

    def _call(self, layer: keras.layers.Layer, own: list[keras.Variable], keras_call: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.paused or id(layer) in self._gathered:  # called again inside its own call, or in backward
                return keras_call(*args, **kwargs)
            self._gather(layer, own)
            try:
                outputs = keras_call(*args, **kwargs)
            finally:
                self._free(layer, own)
            if torch.is_grad_enabled():
                for output in keras.tree.flatten(outputs):
                    if isinstance(output, torch.Tensor) and output.requires_grad:
                        output.register_hook(self._before_backward(layer, own))
            return outputs

        return call

    def _before_backward(self, layer: keras.layers.Layer, own: list[keras.Variable]) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if id(layer) not in self._gathered:
                self._gather(layer, own)
                self._gathered[id(layer)] = {id(v) for v in own if internals.stored_value(v).requires_grad}

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

        return hook

    def _gather(self, layer: keras.layers.Layer, own: list[keras.Variable]) -> None:
        """The layer's weights broadcast from their owners (one broadcast per owner and dtype), a split
        one's rows from each replica into its whole."""
        started = time.perf_counter()
        groups: dict[tuple[int, torch.dtype], list[Held]] = {}
        wholes: dict[int, torch.Tensor] = {}
        for variable in own:
            for piece in self._pieces[id(variable)]:
                groups.setdefault((piece.owner, dtype_of(variable)), []).append(Held(variable, piece.rows))
            if len(self._pieces[id(variable)]) > 1:
                rows = self._rows[id(variable)] = internals.stored_value(variable).data
                wholes[id(variable)] = torch.empty(tuple(variable.shape), dtype=rows.dtype, device=self.device)
        for (owner, dtype), group in groups.items():
            if owner == self.rank:
                flat = torch.cat([internals.stored_value(h.variable).detach().reshape(-1) for h in group])
            else:
                flat = torch.empty(sum(held_numel(h) for h in group), dtype=dtype, device=self.device)
            _entering()
            dist.broadcast(flat, src=owner, group=self.group)
            for held, piece in zip(group, pieces_of_flat(group, flat), strict=True):
                if held.rows is not None:
                    wholes[id(held.variable)][held.rows[0] : held.rows[1]] = piece
                elif owner != self.rank:
                    internals.stored_value(held.variable).data = piece
        for variable in own:
            if id(variable) in wholes:
                internals.stored_value(variable).data = wholes[id(variable)]
        self._gathered[id(layer)] = set()
        self.seconds += time.perf_counter() - started

    def _free(self, layer: keras.layers.Layer, own: list[keras.Variable]) -> None:
        for variable in own:
            self._release(variable)
        self._gathered.pop(id(layer), None)

    def _release(self, variable: keras.Variable) -> None:
        """Another owner's whole variable freed; a split one back to its own rows (kept while gathered)."""
        pieces = self._pieces[id(variable)]
        if len(pieces) > 1:
            if id(variable) in self._rows:
                internals.stored_value(variable).data = self._rows.pop(id(variable))
        elif pieces[0].owner != self.rank:
            release(variable)
