"""Access to a scoped model's variables outside a call: what ``value`` reads and ``assign`` writes.

Between calls each replica holds its own parts of a scoped model (``_scope.layout``), the caller rank
0's. Reading one of those variables in the caller (``numpy()``, ``np.array``, Keras's saving) gathers
it from the replicas that hold it, one variable at a time, into a copy that is not kept; assigning one
(``assign``, ``load_weights``) sends each replica its part. A variable still awaiting its first value
reads its initializer's value and is assigned by changing that value. Within a call (``calling``) and
in a worker replica, variables read and write their own storage, as every trainer step expects;
but in rank 0's callbacks during a scoped fit (``served_by``) the variables held by parts are read and
written through the other replicas again, one at a time (``_scope.served``).

Process-global state: ``_holders`` (the holder of each variable held by parts, by identity: the
replica pool that holds the model), ``_held`` (those variables, weakly: what ``release_all`` frees),
``_served`` (set only within a hook of rank 0's, for that hook's variables), ``_registrations`` (Keras
registering storage as torch parameters now) and the count of calls running in this process. Keras's
variable class is hooked once, at the first scope or a worker's first scoped model (``install``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import keras
import torch

from dp_core import ShardMode
from dp_core.keras import internals, is_factory
from torch_dp._internals import guard_variable_access
from torch_dp._scope.deferred import building, deferring, initial_value, is_deferred, scoped_mode, set_initial_value
from torch_dp._scope.loading import StoredValue, stored
from torch_dp._step.owners import release


class Holder(Protocol):
    """What holds a scoped model's parts between calls (the replica pool)."""

    def read_variable(self, variable: keras.Variable) -> torch.Tensor:
        """The variable's whole value, gathered from its holders."""
        ...

    def write_variable(self, variable: keras.Variable, value: Any) -> None:
        """Each holder given its part of ``value``."""
        ...


class Lost:
    """The holder of a model whose replicas stopped: its parts are gone, and every access says so."""

    def read_variable(self, variable: keras.Variable) -> torch.Tensor:
        raise RuntimeError(_lost(variable))

    def write_variable(self, variable: keras.Variable, value: Any) -> None:
        raise RuntimeError(_lost(variable))


def _lost(variable: keras.Variable) -> str:
    return (
        f"the variable '{variable.path}' belongs to a model built in a torch_dp trainer's scope, whose parts were "
        "held by that trainer's replicas, and those replicas stopped (trainer.close(), another Trainer starting "
        "its own, or a failed call): the model's state is gone. Save a scoped model (model.save) or train it with "
        "checkpoint_dir before closing its trainer; build it again in the scope to go on."
    )


_holders: dict[int, Holder] = {}
_held: weakref.WeakValueDictionary[int, keras.Variable] = weakref.WeakValueDictionary()  # those variables
_calls = 0
_installed = False
_scopes = 0  # scopes entered now: load_weights hands variables where their values lie (``_scope.loading``)
_registrations = 0  # Keras's torch layers registering variables' storage as parameters now
_served: tuple[Holder, frozenset[int]] | None = None  # rank 0 in a scoped fit's hook: who serves which variables


@contextlib.contextmanager
def trainer_scope(
    mode: ShardMode | None, *, under_cluster: bool, mesh: tuple[int, int] | None = None
) -> Iterator[None]:
    """``torch_dp.Trainer.scope()``: variables created inside are deferred under the trainer's ``mode``
    (and its ``mesh``'s ``(rows, columns)``, a mesh trainer's)."""
    if under_cluster:
        raise NotImplementedError(
            "torch_dp.Trainer.scope() runs with spawned replicas (Trainer(num_replicas=N) in one process); under "
            "torchrun or SLURM each process would hold only its part and no process could read the model whole. "
            "Build the model outside the scope there (shard='full' splits its training state)."
        )
    global _scopes
    install()
    _scopes += 1
    try:
        with deferring(mode, mesh):
            yield
    finally:
        _scopes -= 1


def install() -> None:
    """Keras's variables and files hooked, once per process: at the caller's first scope, and in a worker
    replica that builds a scoped model (whose build reads and sets first values, ``_read``)."""
    global _installed
    if not _installed:
        guard_variable_access(_read, _write, _keep, _registering)
        internals.install_keras_file_hooks(lambda: _scopes > 0, stored, lambda model: scoped_mode(model)[0])
        _installed = True


def built_in_scope(model: Any, mode: ShardMode | None, *, under_cluster: bool) -> Any:
    """What ``fit`` trains for ``model``: under ``shard="full"`` with spawned replicas, the model of a
    zero-argument factory built in the trainer's scope (as ``with trainer.scope(): model = factory()``,
    and as jax-dp's ``fit`` does); a model, or a factory under another mode or torchrun, as it is."""
    if mode != "full" or under_cluster or not is_factory(model):
        return model
    with trainer_scope(mode, under_cluster=False):
        return model()


def hold(variables: Sequence[keras.Variable], holder: Holder) -> None:
    for variable in variables:
        if id(variable) not in _holders:  # forgotten with the variable: another one may get its identity
            weakref.finalize(variable, _holders.pop, id(variable), None)
        _holders[id(variable)] = holder
        _held[id(variable)] = variable


def holder_of(variable: keras.Variable) -> Holder | None:
    """What holds ``variable``'s parts between calls (a ``Lost`` once its replicas stopped), None if nothing."""
    return _holders.get(id(variable))


def release_all(holder: Holder) -> None:
    """The variables ``holder`` held are lost (its replicas stopped), and this process's parts of them
    freed now: a model is a reference cycle, which Python may free long after the user let it go (one
    was seen alive after ``del`` and a ``gc.collect()``, freed by the next ones), and rank 0's parts
    would stay meanwhile, beside the next model's."""
    lost = Lost()
    for key, found in list(_holders.items()):
        if found is holder:
            _holders[key] = lost
            variable = _held.get(key)
            if variable is not None:
                release(variable)


@contextlib.contextmanager
def calling() -> Iterator[None]:
    """Within the block this process runs a call: variables read their own storage."""
    global _calls
    _calls += 1
    try:
        yield
    finally:
        _calls -= 1


@contextlib.contextmanager
def served_by(holder: Holder, variables: Sequence[keras.Variable]) -> Iterator[None]:
    """Within the block (rank 0's hook in a fit) ``variables`` are read and written through ``holder``,
    as between calls, though a call runs; the others read their storage, as in the call."""
    global _served
    before, _served = _served, (holder, frozenset(id(v) for v in variables))
    try:
        yield
    finally:
        _served = before


@contextlib.contextmanager
def storage_only() -> Iterator[None]:
    """Within the block no variable is served (the holder's own work on the storage)."""
    global _served
    before, _served = _served, None
    try:
        yield
    finally:
        _served = before


def _server(variable: keras.Variable) -> Holder | None:
    if _served is not None and id(variable) in _served[1]:
        return _served[0]
    return None


@contextlib.contextmanager
def _registering() -> Iterator[None]:
    global _registrations
    _registrations += 1
    try:
        yield
    finally:
        _registrations -= 1


def serve_only() -> None:
    """This process is a worker replica: it reads its storage always (the caller reads for the user)."""
    global _calls
    _calls += 1


def _read(variable: keras.Variable) -> torch.Tensor | None:
    server = _server(variable)
    if server is not None:
        return server.read_variable(variable)
    if not _installed or _registrations:  # Keras registering the storage as a parameter takes it
        return None
    if building() and is_deferred(variable):  # a model being built reads its values: in any process
        return initial_value(variable)
    if _calls:
        return None
    holder = _holders.get(id(variable))
    if holder is not None:
        return holder.read_variable(variable)
    if is_deferred(variable):
        return initial_value(variable)
    return None


def _keep(variable: keras.Variable, value: Any) -> bool:
    """A value still in its file stays so for a variable that reads it later (deferred, or held by parts)."""
    return isinstance(value, StoredValue) and not _calls and (is_deferred(variable) or id(variable) in _holders)


def _write(variable: keras.Variable, value: Any) -> bool:
    server = _server(variable)
    if server is not None:
        server.write_variable(variable, value)
        return True
    if _calls and not (building() and is_deferred(variable)):  # a model being built sets its values anywhere
        return False
    holder = _holders.get(id(variable))
    if holder is not None:
        holder.write_variable(variable, value)
        return True
    if is_deferred(variable):
        kept = value if isinstance(value, StoredValue) else keras.ops.convert_to_numpy(value)
        set_initial_value(variable, kept)
        return True
    return False
