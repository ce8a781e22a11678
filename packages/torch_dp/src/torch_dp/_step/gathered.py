"""Weights gathered just in time (``shard="full"``, ZeRO-3): during a fit each replica keeps only its
own trainable variables' weights, and every layer gathers the others' for its forward and its
backward, then frees them.

Each layer with sharded weights of its own has its ``call`` shadowed on the instance (as the
BatchNormalization sync does): before Keras's call the layer's weights are broadcast from their
owners, after it the other replicas' copies are freed. Autograd keeps the ``Parameter``, not its
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
from torch_dp._step.owners import dtype_of, numel, release


def shardable(variable: keras.Variable) -> bool:
    """Whether a trainable variable's weights can be freed between its layer's calls."""
    return getattr(variable, "regularizer", None) is None


@final
class JustInTime:
    """The model's layers, each gathering its own sharded weights around its calls."""

    def __init__(
        self, model: keras.Model, variables: Sequence[keras.Variable], owners: Sequence[int], replica: Replica
    ) -> None:
        self.rank, self.device, self.group = replica.rank, replica.device, replica.group
        self._owner = {id(v): owners[i] for i, v in enumerate(variables) if shardable(v)}
        self._layers: list[tuple[keras.layers.Layer, list[keras.Variable]]] = []
        claimed: set[int] = set()  # a weight shared by two layers is gathered by the first
        for layer in internals.flatten_layers(model, include_self=True):
            own = [v for v in internals.own_trainable_variables(layer) if id(v) in self._owner and id(v) not in claimed]
            claimed.update(id(v) for v in own)
            if own:
                self._layers.append((layer, own))
        self.sharded = [v for v in variables if id(v) in claimed]
        self._gathered: dict[int, set[int]] = {}  # layer id -> its weights still waiting for a gradient
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
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        self._gathered = {}

    def free_all(self) -> None:
        """Every other replica's weights freed (after a step, where some got no gradient)."""
        for variable in self.sharded:
            if self._owner[id(variable)] != self.rank:
                release(variable)
        self._gathered = {}

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def owned(self, owner: int) -> list[keras.Variable]:
        return [v for v in self.sharded if self._owner[id(v)] == owner]

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
        """The layer's weights broadcast from their owners: one broadcast per owner and dtype."""
        started = time.perf_counter()
        groups: dict[tuple[int, torch.dtype], list[keras.Variable]] = {}
        for variable in own:
            groups.setdefault((self._owner[id(variable)], dtype_of(variable)), []).append(variable)
        for (owner, dtype), group in groups.items():
            sizes = [numel(v) for v in group]
            if owner == self.rank:
                flat = torch.cat([internals.stored_value(v).detach().reshape(-1) for v in group])
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
            _entering()
            dist.broadcast(flat, src=owner, group=self.group)
            if owner != self.rank:
                for variable, piece in zip(group, torch.split(flat, sizes), strict=True):
                    internals.stored_value(variable).data = piece.view(tuple(variable.shape))
        self._gathered[id(layer)] = set()
        self.seconds += time.perf_counter() - started

    def _free(self, layer: keras.layers.Layer, own: list[keras.Variable]) -> None:
        for variable in own:
            if self._owner[id(variable)] != self.rank:
                release(variable)
        self._gathered.pop(id(layer), None)
