"""The private torch (and multiprocessing) attributes torch-dp uses, each with its reason (and the one
private Keras attribute it sets itself: a variable's shape, ``with_keras_shape``)."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import keras
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d  # pyright: ignore[reportPrivateImportUsage]


def version(tensor: torch.Tensor) -> int:
    """How many times ``tensor`` was changed in place (``Tensor._version``, the counter autograd
    checks). Keras assigns variables in place, so an unchanged (identity, version) pair means
    an unchanged value: the replica pool skips re-sending a model nobody touched."""
    return tensor._version


def copy_each(into: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Each of ``values`` copied into its tensor of ``into`` in one call (``torch._foreach_copy_``, what
    torch's own optimizers and FSDP2 copy lists with): one dispatch for the list, where a copy each
    costs a step's host a few microseconds per tensor (``_step.undo``)."""
    torch._foreach_copy_(into, values)  # pyright: ignore[reportPrivateImportUsage]


def with_keras_shape(variable: keras.Variable, shape: tuple[int, ...]) -> Callable[[], None]:
    """``variable`` says it has ``shape`` (``KerasVariable._shape``, all that ``shape`` reads) until the
    returned function puts its own back. Keras's optimizer updates a split variable's part through
    the variable itself (``_step.parts``): its ``assign`` refuses a value of another shape than the
    one the variable says it has, and Keras has no public way to change it."""
    own = variable._shape
    variable._shape = shape

    def put_back() -> None:
        variable._shape = own

    return put_back


def set_collective_timeout(seconds: float, group: dist.ProcessGroup) -> None:
    """Bound each later collective of ``group`` by ``seconds``. A group is formed under one
    timeout (gloo and NCCL wait for their peers' addresses under the group's own), and torch has
    no public setter for another one after that; ``_set_pg_timeout`` is what
    ``torch.distributed.breakpoint`` uses to lengthen it."""
    distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def hide_default_group() -> dist.ProcessGroup:
    """The group ``init_process_group`` just formed, taken out of torch's default place
    (``_world.default_pg``, all that ``is_initialized`` reads) and left registered
    (``_world.pg_map``, ``pg_group_ranks``: what a collective given ``group=`` reads).

    Keras 3.16's torch backend changes behaviour whenever ``is_initialized()``: a plain
    ``model.fit`` wraps the model in ``DistributedDataParallel`` (which waits for peers that never
    come while a pool is kept), ``Model.get_metrics_result`` all-reduces over the default group.
    torch-dp's group is its own: each of its collectives names it. torch has no public way to form
    a group without a default one."""
    group = distributed_c10d._world.default_pg
    assert group is not None, "called right after init_process_group"
    distributed_c10d._world.default_pg = None
    return group


def destroy_hidden_group(group: dist.ProcessGroup) -> None:
    """Destroy ``group`` (``hide_default_group``'s). While no other default group took its place it
    is put back and destroyed as the default, as before it was hidden: torch then also resets its
    count of groups, which names the next group (and prefixes its keys in the rendezvous store), so
    a later pool's caller names its group as its fresh workers do. A group already destroyed (the
    user's ``destroy_process_group()`` of a default group of their own destroys every group) is left."""
    if group not in distributed_c10d._world.pg_map:
        return
    if distributed_c10d._world.default_pg is None:
        distributed_c10d._world.default_pg = group
        dist.destroy_process_group()
    else:  # the user formed a default group of their own meanwhile: it stays
        dist.destroy_process_group(group)


@contextlib.contextmanager
def no_default_group() -> Iterator[None]:
    """No default group while torch-dp reads a model's own ``get_metrics_result`` on summed states:
    under torchrun with the user's own default group (which torch-dp then uses, and leaves as it
    is), Keras 3.16's would all-reduce the sums again. Put back after, also on an error."""
    default = distributed_c10d._world.default_pg
    distributed_c10d._world.default_pg = None
    try:
        yield
    finally:
        distributed_c10d._world.default_pg = default


def starting_as_spawned_child() -> bool:
    """Whether this process is a spawned child still importing its parent's main module
    (``Process._inheriting``, the flag ``multiprocessing.spawn`` itself checks before it refuses
    a start from an unguarded main)."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


@contextlib.contextmanager
def variables_created_empty(record: Callable[[keras.Variable, Any], None]) -> Iterator[None]:
    """Within the block a ``keras.Variable`` made from an initializer holds empty storage of its dtype
    (its shape kept by Keras apart, as a freed optimizer slot's is) and ``record(variable, initializer)``
    is called instead of the initializer. ``_initialize_with_initializer`` is the one place where
    Keras 3.10 to 3.16 runs a variable's initializer (3.16's torch ``Variable`` overrides it for
    ``keras.distribution``, which a trainer's scope refuses); Keras has no public hook before the value
    is made. Variables made from a value (an optimizer's iteration count) are left to Keras."""
    variable_class: Any = keras.Variable
    keras_initialize = variable_class._initialize_with_initializer

    def initialize(variable: Any, initializer: Any) -> None:
        dtype = getattr(torch, keras.backend.standardize_dtype(variable._dtype))
        device = torch.as_tensor(keras.ops.convert_to_tensor(0)).device  # Keras's default device, as a value's
        empty = torch.empty(0, dtype=dtype, device=device)
        variable._value = torch.nn.Parameter(empty, requires_grad=bool(variable.trainable and dtype.is_floating_point))
        record(variable, initializer)

    variable_class._initialize_with_initializer = initialize
    try:
        yield
    finally:
        variable_class._initialize_with_initializer = keras_initialize


def guard_variable_access(
    read: Callable[[keras.Variable], torch.Tensor | None],
    write: Callable[[keras.Variable, Any], bool],
    keep: Callable[[keras.Variable, Any], bool],
    registering: Callable[[], contextlib.AbstractContextManager[None]],
) -> None:
    """Every later read of a ``keras.Variable``'s ``value`` asks ``read(variable)`` first (a tensor: the
    value to use; None: Keras's own), and every ``assign`` asks ``write(variable, value)`` (True: done).
    A variable of a model built in a torch-dp scope holds only its replica's part between calls, and
    ``value`` (what ``numpy()``, ``np.array`` and Keras's saving read) and ``_direct_assign`` (what
    ``assign`` and ``load_weights`` end in) are the two places every access passes; Keras has no
    public hook. ``_convert_to_tensor`` (what ``assign`` converts a value with first) leaves a value as it
    is where ``keep(variable, value)`` (a value still in its file, for a variable that reads it later).
    Within ``registering()`` (Keras's torch layers registering each variable's storage as a parameter)
    ``read`` must answer None. Installed once per process (``_scope.held``)."""
    variable_class: Any = keras.Variable
    keras_value = variable_class.value
    keras_assign = variable_class._direct_assign
    keras_convert = variable_class._convert_to_tensor

    def convert_to_tensor(variable: Any, new_value: Any, dtype: Any = None) -> Any:
        return new_value if keep(variable, new_value) else keras_convert(variable, new_value, dtype=dtype)

    def value(variable: Any) -> Any:
        found = read(variable)
        return keras_value.fget(variable) if found is None else found

    def direct_assign(variable: Any, new_value: Any) -> None:
        if not write(variable, new_value):
            keras_assign(variable, new_value)

    variable_class.value = property(value)
    variable_class._direct_assign = direct_assign
    variable_class._convert_to_tensor = convert_to_tensor
    # Keras's torch layers register each variable's storage as their torch parameter by reading its
    # ``value``: those reads run within ``registering()`` (the storage, never a value read for the user)
    from keras.src.backend.torch.layer import TorchLayer

    for name in ("_track_variables", "_post_track_variable"):
        original = getattr(TorchLayer, name)

        def registered(layer: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            with registering():
                return _original(layer, *args, **kwargs)

        setattr(TorchLayer, name, registered)


def set_stored_value(variable: keras.Variable, value: torch.Tensor) -> None:
    """``variable``'s storage made ``value`` (its ``Parameter`` kept): a deferred variable's first value."""
    variable._value.data = value


def new_subgroups(group: dist.ProcessGroup | None, members: list[list[int]]) -> list[Any]:
    """One process group per list of ranks in ``members`` (ranks of ``group``; None: torch's default
    group), in that order; every process of ``group`` calls this with the same lists, as ``new_group``
    asks. A process gets ``dist.GroupMember.NON_GROUP_MEMBER`` for a group it is not in.

    ``new_group`` forms a group out of torch's default one only, and torch-dp's own group is kept out of
    that place (``hide_default_group``): it stands there for this call, and what stood there before is put
    back. Each new group's ranks then read as its own (``_world.pg_group_ranks``, which a collective's
    ``src=``/``dst=`` is looked up in): torch-dp names a peer by its rank among its replicas (``src=0``),
    which is its rank in its own group, as in the group of all the replicas."""
    default = distributed_c10d._world.default_pg
    if group is not None:
        distributed_c10d._world.default_pg = group
    try:
        groups = [dist.new_group(ranks) for ranks in members]
    finally:
        distributed_c10d._world.default_pg = default
    for formed, ranks in zip(groups, members, strict=True):
        if isinstance(formed, dist.ProcessGroup):  # not NON_GROUP_MEMBER
            distributed_c10d._world.pg_group_ranks[formed] = {rank: rank for rank in range(len(ranks))}
    return groups


def backend_apply_gradients(optimizer: keras.optimizers.Optimizer) -> Callable[[list[Any], list[Any]], Any]:
    """The optimizer's current ``_backend_apply_gradients(grads, variables)``: where Keras clips the
    gradients (``_clip_gradients``) with the variables at hand, which a wrapper can note first."""
    apply: Any = optimizer._backend_apply_gradients
    return apply
