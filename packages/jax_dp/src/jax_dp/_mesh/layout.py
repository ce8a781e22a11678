"""Model parallel: which mesh axes split each variable (``Trainer(layout=...)``).

A layout maps regular expressions over a Keras variable's ``.path`` to a partition spec,
one entry per dimension of the variable: ``None`` (whole), a mesh axis name, or a tuple of
axis names. ``{"dense.*kernel": (None, "model")}`` splits every matching kernel's columns
over the ``"model"`` axis. A dict's first rule whose pattern ``re.search``-es the path wins;
a ``keras.distribution.LayoutMap`` is looked up as Keras looks it up (its own ``[path]``).
Variables no rule matches are replicated.

A model's variables, its Keras optimizer's slots (each slot like the variable it was made
for: Keras names a slot after its variable's path) and an optax state's per-parameter leaves
lie on the mesh as ``NamedSharding(mesh, P(*spec))``; the jitted steps keep them so, and
XLA's SPMD partitioner adds the collectives over ``"model"``. ``place`` checks a model's
rules against the mesh before anything runs and returns the call's ``Placement`` (mesh, layout,
shard mode), which every function that puts the call's state on the mesh takes
(``weight_shardings``, ``optimizer_shardings``, ...): nothing is recorded between calls.

Sharded state (``Trainer(shard=...)``, ZeRO-1/2/3): ``"optimizer"`` and ``"gradients"`` split each
optimizer slot of a large trainable variable over ``"batch"`` as well, ``"full"`` its weight too
(the slots following it). The split is derived, not written: a variable of at least
``SHARD_MIN_ELEMENTS`` elements gets ``"batch"`` on its largest dimension that its layout leaves
whole and that divides by the ``"batch"`` size (``sharded_spec``); a smaller one, or one with no
such dimension, keeps its layout's spec. So a layout rule's ``"model"`` split stays and ``"batch"``
joins it on another dimension. Each device then holds ``1/N`` of the split arrays, and XLA's SPMD
partitioner updates each slot on its part and gathers what a computation needs whole. The
values are those of the unsplit program: where an array lies never changes what is computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import keras
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dp_core import ShardMode
from dp_core.keras import LayoutRules, spec_axes
from jax_dp._mesh.mesh import BATCH_AXIS

Spec = tuple[Any, ...]
SHARD_MIN_ELEMENTS = 2**14
"""The smallest variable (in elements: 64 KiB of float32) whose state ``shard=`` splits over
``"batch"``. Below it, a split saves less memory than the gather it costs in latency: biases,
BatchNormalization's vectors and small kernels stay replicated."""


class Layout(LayoutRules):
    """Parsed ``layout=`` rules (``dp_core.keras.LayoutRules``); equal layouts compile the same steps
    (``_step.compile_cache``)."""

    def check_axes(self, mesh: Mesh) -> None:
        """Every axis a rule names is one of the mesh's."""
        for pattern, spec, axis in self.named_axes():
            if axis not in mesh.axis_names:
                raise ValueError(
                    f"layout rule {pattern!r}: {spec} names the axis {axis!r}, but the mesh's axes are "
                    f"{mesh.axis_names} (sizes {dict(mesh.shape)}). Use a 2-D mesh with axes ('batch', 'model'), "
                    "e.g. jax.make_mesh((2, 2), ('batch', 'model')), and name only its axes."
                )


class WeightShardings(NamedTuple):
    """One model's shardings, in ``trainable_variables``/``non_trainable_variables`` order."""

    trainable: list[NamedSharding]
    non_trainable: list[NamedSharding]


@dataclass(frozen=True)
class Placement:
    """Where one trainer call puts a model's state: the mesh, the variable layout and the shard
    mode. Built per call (``place``) and handed to the steps and the state that follow it; equal
    placements compile the same steps (``_step.recipes``). ``Placement(mesh)``: replicated."""

    mesh: Mesh
    layout: Layout = field(default_factory=Layout)
    shard: ShardMode | None = None  # None: the state replicated over "batch"


def place(model: keras.Model, mesh: Mesh, layout: Layout, shard: ShardMode | None = None) -> Placement:
    """The call's placement, with ``layout`` checked against ``model``'s variables on ``mesh`` (a
    clear error for a rule that does not fit)."""
    for variable in [*model.trainable_variables, *model.non_trainable_variables]:
        _checked_sharding(variable, layout, mesh)
    return Placement(mesh, layout, shard)


def weight_shardings(model: keras.Model, placement: Placement) -> WeightShardings:
    """Where each of the model's variables lies: as the layout says, and with ``shard="full"``
    a large trainable one split over ``"batch"`` too."""
    mesh, layout = placement.mesh, placement.layout
    trainable = [_checked_sharding(v, layout, mesh) for v in model.trainable_variables]
    if placement.shard == "full":
        pairs = zip(model.trainable_variables, trainable, strict=True)
        trainable = [_split_over_batch(s, tuple(v.shape)) for v, s in pairs]
    return WeightShardings(
        trainable=trainable,
        non_trainable=[_checked_sharding(v, layout, mesh) for v in model.non_trainable_variables],
    )


def variable_sharding(variable: Any, placement: Placement) -> NamedSharding:
    """Where one variable lies under ``placement``, as ``weight_shardings`` places it: its layout's
    spec, and with ``shard="full"`` split over ``"batch"`` too when it is large and trainable (a
    trainer's ``scope()`` asks this as Keras creates each variable)."""
    sharding = _checked_sharding(variable, placement.layout, placement.mesh)
    if placement.shard == "full" and variable.trainable:
        return _split_over_batch(sharding, tuple(variable.shape))
    return sharding


def variable_slot_sharding(variable: Any, placement: Placement) -> NamedSharding:
    """Where the optimizer slots of one trainable variable lie under ``placement`` (``slot_shardings``'s
    rule for one variable)."""
    weight = variable_sharding(variable, placement)
    return weight if placement.shard is None else _split_over_batch(weight, tuple(variable.shape))


def slot_shardings(model: keras.Model, placement: Placement) -> list[NamedSharding]:
    """Where the optimizer state of each trainable variable lies: like the variable, and in any
    shard mode split over ``"batch"`` when large (``sharded_spec``)."""
    weights = weight_shardings(model, placement).trainable
    if placement.shard is None:
        return weights
    return [_split_over_batch(s, tuple(v.shape)) for v, s in zip(model.trainable_variables, weights, strict=True)]


def gradient_shardings(model: keras.Model, placement: Placement) -> list[NamedSharding] | None:
    """Where the train step puts the global gradients before the optimizer update: with
    ``shard="gradients"`` or ``"full"`` like the slots, so XLA reduce-scatters them rather than
    all-reducing; None (XLA's choice: all-reduced, replicated) otherwise."""
    if placement.shard not in ("gradients", "full"):
        return None
    return slot_shardings(model, placement)


def sharded_spec(spec: Spec, shape: tuple[int, ...], batch_size: int) -> Spec:
    """``spec`` with ``"batch"`` on the largest dimension it leaves whole that divides by
    ``batch_size``, for a variable of at least ``SHARD_MIN_ELEMENTS`` elements; else ``spec``.

    >>> sharded_spec((), (64, 512), 4)  # doctest: +SKIP  (with SHARD_MIN_ELEMENTS at 2**14)
    (None, 'batch')
    >>> sharded_spec((None, "model"), (512, 64), 4)  # doctest: +SKIP
    ('batch', 'model')
    """
    if batch_size == 1 or math.prod(shape) < SHARD_MIN_ELEMENTS or BATCH_AXIS in spec_axes(spec):
        return spec
    full = tuple(spec) + (None,) * (len(shape) - len(spec))
    whole = [d for d, entry in enumerate(full) if entry is None and shape[d] % batch_size == 0]
    if not whole:
        return spec
    largest = max(whole, key=lambda d: (shape[d], -d))  # the first of equally large ones
    return (*full[:largest], BATCH_AXIS, *full[largest + 1 :])


def _split_over_batch(sharding: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
    mesh = sharding.mesh
    spec = sharded_spec(tuple(sharding.spec), shape, int(mesh.shape[BATCH_AXIS]))
    return NamedSharding(mesh, P(*spec))


def _checked_sharding(variable: Any, layout: Layout, mesh: Mesh) -> NamedSharding:
    spec = layout.spec_for(variable.path) if layout else None
    if spec is None:
        return NamedSharding(mesh, P())
    shape = tuple(variable.shape)
    where = f"layout puts the variable {variable.path!r} (shape {shape}) as {spec} on the mesh {dict(mesh.shape)}"
    if len(spec) > len(shape):
        raise ValueError(
            f"{where}, but the spec has {len(spec)} entries for {len(shape)} dimension(s). Give at most one "
            "entry per dimension (None keeps a dimension whole), or narrow the rule's pattern."
        )
    for dimension, entry in enumerate(spec):
        axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        for axis in axes:
            if axis not in mesh.axis_names:
                raise ValueError(f"{where}, but the mesh has no axis {axis!r}. Name only {mesh.axis_names}.")
        parts = math.prod(mesh.shape[axis] for axis in axes)
        if shape[dimension] % parts:
            raise ValueError(
                f"{where}, but dimension {dimension} of size {shape[dimension]} does not divide into the "
                f"{parts} part(s) of {entry!r}. Choose a mesh whose axis size divides {shape[dimension]}, "
                "change the layer's size, or leave that dimension whole (None)."
            )
    return NamedSharding(mesh, P(*spec))


def optimizer_shardings(
    optimizer: keras.optimizers.Optimizer, model: keras.Model, placement: Placement
) -> list[NamedSharding]:
    """Where each variable of ``model``'s Keras optimizer lies: a slot like the variable it was
    made for, the rest (iterations, learning rate, loss scale) replicated.

    Keras names a slot ``{variable.path with '/' as '_'}_{slot}`` with the variable's shape
    (``add_variable_from_reference``); the longest such variable path wins. Slots are Adam's
    moments, momentum, EMA copies and the gradient accumulators alike."""
    replicated = NamedSharding(placement.mesh, P())
    if not placement.layout and placement.shard is None:
        return [replicated] * len(optimizer.variables)
    owners = sorted(
        zip(model.trainable_variables, slot_shardings(model, placement), strict=True),
        key=lambda pair: -len(pair[0].path),
    )
    shardings = []
    for slot in optimizer.variables:
        sharding = replicated
        for variable, variable_sharding in owners:
            if slot.name.startswith(variable.path.replace("/", "_") + "_") and tuple(slot.shape) == tuple(
                variable.shape
            ):
                sharding = variable_sharding
                break
        shardings.append(sharding)
    return shardings


def optax_state_shardings(transformation: optax.GradientTransformation, params: list[Any], mesh: Mesh) -> Any:
    """Where each leaf of ``transformation``'s state over ``params`` (``ShapeDtypeStruct`` with the
    slots' shardings, ``abstract_slots``) lies: a per-parameter leaf like its parameter's slots, the
    rest replicated."""
    shapes = jax.eval_shape(transformation.init, params)
    return optax.tree_map_params(
        transformation,
        lambda _, param: param.sharding,
        shapes,
        params,
        transform_non_params=lambda _: NamedSharding(mesh, P()),
    )


def abstract_slots(model: keras.Model, placement: Placement) -> list[jax.ShapeDtypeStruct]:
    """The model's trainable variables as the shapes and dtypes of their optimizer state, with
    its shardings (``slot_shardings``)."""
    shardings = slot_shardings(model, placement)
    return [
        jax.ShapeDtypeStruct(tuple(v.shape), v.dtype, sharding=s)
        for v, s in zip(model.trainable_variables, shardings, strict=True)
    ]
