"""The mesh and the variable layout of ``Trainer(mesh=..., layout=...)``, and the call's ``MeshPlan``.

The mesh is a grid of processes with the axes ``("batch", "model")``: ``(R, C)`` is R rows of C
processes, process ``row * C + column`` at (row, column). Each row is one data-parallel replica (all
its processes read the same rows of each global batch); along a row the Dense, EinsumDense and
Embedding layers a rule splits hold a part of their weight each (``_mesh.layers``).

The layout is jax-dp's (``jax_dp._mesh.layout``), so one layout serves both backends: a dict of
``{regular expression over a variable's .path: partition spec}``, the first rule that
``re.search``-es the path winning, or a ``keras.distribution.LayoutMap`` looked up as Keras looks
it up. A spec has one entry per dimension (``None``: whole, ``"model"``: split over the row), fewer
entries leaving the rest whole. This slice splits a Dense kernel by columns (``(None, "model")``,
its bias with it or whole) or by rows (``("model", None)``, its bias whole), an EinsumDense kernel
along a dimension its equation keeps in the output (outputs gathered) or sums over (inputs sliced),
its bias whole, and an Embedding's embeddings by columns or by rows (the vocabulary); any other split
is refused before anything starts, by ``plan_for``, in the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import keras

from dp_core.keras import LayoutRules, internals, spec_axes

BATCH_AXIS = "batch"
MODEL_AXIS = "model"
Spec = tuple[Any, ...]


@dataclass(frozen=True)
class Mesh:
    """``rows`` replicas of ``columns`` processes each; process ``row * columns + column``."""

    rows: int
    columns: int

    @property
    def num_processes(self) -> int:
        return self.rows * self.columns

    def shape(self) -> dict[str, int]:
        return {BATCH_AXIS: self.rows, MODEL_AXIS: self.columns}

    def row_ranks(self) -> list[list[int]]:
        return [[row * self.columns + column for column in range(self.columns)] for row in range(self.rows)]

    def column_ranks(self) -> list[list[int]]:
        return [[row * self.columns + column for row in range(self.rows)] for column in range(self.columns)]


def mesh_of(mesh: Any) -> Mesh:
    """``mesh`` (``(rows, columns)`` or a torch ``DeviceMesh`` with the axes ``("batch", "model")``) as a ``Mesh``."""
    names = getattr(mesh, "mesh_dim_names", None)
    sizes = tuple(mesh.shape) if names is not None else mesh
    if names is not None and tuple(names) != (BATCH_AXIS, MODEL_AXIS):
        raise ValueError(f"mesh= takes a DeviceMesh with the axes ('batch', 'model'), got the axes {tuple(names)}.")
    if (
        not isinstance(sizes, (tuple, list))
        or len(sizes) != 2
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes)
    ):
        raise ValueError(
            f"mesh= takes (rows, columns), two positive integers (rows: data-parallel replicas over 'batch', "
            f"columns: processes per replica over 'model'), or a torch DeviceMesh of those axes; got {mesh!r}."
        )
    return Mesh(int(sizes[0]), int(sizes[1]))


class Layout(LayoutRules):
    """Parsed ``layout=`` rules (``dp_core.keras.LayoutRules``, jax-dp's meaning)."""

    def check_axes(self, mesh: Mesh) -> None:
        """Every axis a rule names is the mesh's, and only ``"model"`` splits a variable here."""
        for pattern, spec, axis in self.named_axes():
            if axis not in (BATCH_AXIS, MODEL_AXIS):
                raise ValueError(
                    f"layout rule {pattern!r}: {spec} names the axis {axis!r}, but the mesh's axes are "
                    f"('batch', 'model') (sizes {mesh.shape()}). Name only 'model' (or None for a whole dimension)."
                )
            if axis == BATCH_AXIS:
                raise ValueError(
                    f"layout rule {pattern!r}: {spec} splits a variable over 'batch', which torch-dp does not "
                    "build: each row of its mesh holds every variable (split over 'model' only). Leave 'batch' "
                    "out of the spec."
                )


class LayerSplit(NamedTuple):
    """One layer split along a row: ``layer``, its index among the model's ``splittable_layers`` (a
    worker's copy names its variables' paths after its own model name), and ``weight``, its weight's
    path in the caller (to name it): a Dense's kernel, an Embedding's embeddings. ``dimension`` 1 splits
    the weight's columns (each process computes its part of the outputs), 0 its rows (a Dense: its
    part of the inputs, partial products summed; an Embedding: its part of the vocabulary);
    ``bias_split``: a Dense column split's bias split with its columns. ``gathers``: the outputs are
    gathered over the row along ``axis`` (else the inputs are sliced along ``axis``, an Embedding's
    ids by vocabulary, and the partial outputs summed)."""

    layer: int
    weight: str
    dimension: int
    bias_split: bool
    gathers: bool
    axis: int = -1


@dataclass(frozen=True)
class MeshPlan:
    """What a call runs on the mesh: the mesh, and the layers it splits (the rest is whole everywhere)."""

    mesh: Mesh
    splits: tuple[LayerSplit, ...]


def plan_for(model: keras.Model, mesh: Mesh, layout: Layout) -> MeshPlan:
    """``model``'s splits under ``layout`` on ``mesh``, each rule checked against its variables (a clear
    error, before anything starts, for a split this slice does not build)."""
    if not model.built:
        raise ValueError(
            "Trainer(mesh=...) needs a built model, to check its layout before any process starts: "
            "give it an input (keras.Input(...)) or call model.build(input_shape) first."
        )
    owned = {id(v) for layer in splittable_layers(model) for v in _splittable_variables(layer)}
    specs: dict[int, Spec] = {}
    for variable in model.weights:
        spec = _padded(layout.spec_for(variable.path), variable, mesh)
        if MODEL_AXIS not in spec:
            continue
        _check_divides(variable, spec, mesh)
        if id(variable) not in owned:
            _refuse_owner(variable, spec, mesh, model)
        specs[id(variable)] = spec
    splits = []
    for index, layer in enumerate(splittable_layers(model)):
        weight = specs.get(id(weight_of(layer)))
        bias = None if bias_of(layer) is None else specs.get(id(bias_of(layer)))
        if weight is not None or bias is not None:
            splits.append(_layer_split(index, layer, weight, bias, mesh))
    if mesh.columns == 1:  # one process per row: every part is the whole
        splits = []
    return MeshPlan(mesh, tuple(splits))


def splittable_layers(model: keras.Model) -> list[Any]:
    """The model's layers of the kinds a rule may split (Dense, EinsumDense, Embedding), in ``flatten_layers``'
    order."""
    kinds = (keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Embedding)
    return [layer for layer in internals.flatten_layers(model) if isinstance(layer, kinds)]


def weight_of(layer: Any) -> keras.Variable:
    """A Dense's or EinsumDense's kernel, an Embedding's embeddings."""
    return layer.embeddings if isinstance(layer, keras.layers.Embedding) else layer.kernel


def bias_of(layer: Any) -> keras.Variable | None:
    return None if isinstance(layer, keras.layers.Embedding) else layer.bias


def _splittable_variables(layer: Any) -> list[keras.Variable]:
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None) is not None:
        return []  # a LoRA or quantized weight is not one variable: a rule on it is refused as not a layer's
    bias = bias_of(layer)
    return [weight_of(layer), *([bias] if bias is not None else [])]


def _where(variable: keras.Variable, spec: Spec, mesh: Mesh) -> str:
    shape = tuple(variable.shape)
    return f"layout puts the variable {variable.path!r} (shape {shape}) as {spec} on the mesh {mesh.shape()}"


def _padded(spec: Spec | None, variable: keras.Variable, mesh: Mesh) -> Spec:
    """``spec`` with one entry per dimension of ``variable`` (None: replicated)."""
    rank = len(variable.shape)
    spec = spec or ()
    if len(spec) > rank:
        raise ValueError(
            f"{_where(variable, spec, mesh)}, but the spec has {len(spec)} entries for a variable of "
            f"{rank} dimension(s). Give one entry per dimension (None keeps a dimension whole)."
        )
    if any(isinstance(entry, tuple) for entry in spec) or spec_axes(spec).count(MODEL_AXIS) > 1:
        raise ValueError(
            f"{_where(variable, spec, mesh)}, but torch-dp splits a variable over 'model' along one dimension "
            "only. Name 'model' once, alone, and leave the other dimensions None."
        )
    return (*spec, *([None] * (rank - len(spec))))


def _check_divides(variable: keras.Variable, spec: Spec, mesh: Mesh) -> None:
    dimension = spec.index(MODEL_AXIS)
    size = int(variable.shape[dimension])
    if size % mesh.columns:
        raise ValueError(
            f"{_where(variable, spec, mesh)}, but dimension {dimension} of size {size} does not divide into the "
            f"{mesh.columns} part(s) of 'model'. Choose a mesh whose axis size divides {size}, change the layer's "
            "size, or leave that dimension whole (None)."
        )


def _refuse_owner(variable: keras.Variable, spec: Spec, mesh: Mesh, model: keras.Model) -> None:
    owner = next(
        (
            type(layer).__name__
            for layer in internals.flatten_layers(model)
            if any(v is variable for v in layer.weights)
        ),
        "no layer",
    )
    raise ValueError(
        f"{_where(variable, spec, mesh)}, but torch-dp splits only the kernels and biases of Dense and EinsumDense "
        "layers and the embeddings of Embedding layers (without LoRA or quantization) so far, and this variable is a "
        f"{owner}'s. Leave it whole (no rule, or a narrower pattern), or train the model with jax_dp, which "
        "splits any variable."
    )


def _layer_split(index: int, layer: Any, weight: Spec | None, bias: Spec | None, mesh: Mesh) -> LayerSplit:
    """How ``layer`` splits: a Dense by columns (its bias split or whole) or by rows (its bias whole), an
    EinsumDense as its equation says (``_einsum_split``), an Embedding by columns or rows."""
    path = weight_of(layer).path
    einsum = isinstance(layer, keras.layers.EinsumDense)
    if weight is not None and einsum and bias is None:
        return _einsum_split(index, layer, weight, mesh)
    if weight is not None and not einsum and (weight.index(MODEL_AXIS) == 1 or bias is None):
        dimension = weight.index(MODEL_AXIS)
        return LayerSplit(index, path, dimension, bias is not None, gathers=dimension == 1)
    spec = weight or bias or ()
    variable = bias_of(layer) if weight is None else weight_of(layer)
    assert variable is not None
    how = "whole" if weight is None else "split" if einsum else "split by rows"
    raise ValueError(
        f"{_where(variable, spec, mesh)}, but a bias splits only with a Dense kernel's columns: {layer.name!r}'s "
        f"kernel is {how} and its bias split. Split a Dense kernel's columns too ((None, 'model')), or leave the "
        "bias whole."
    )


def _einsum_split(index: int, layer: Any, spec: Spec, mesh: Mesh) -> LayerSplit:
    """An EinsumDense kernel split along a dimension its equation keeps in the output (each process computes
    its part of the output, gathered along that axis) or sums over (each takes its part of the input)."""
    inputs, rest = layer.equation.split(",")
    kernel_letters, output = rest.split("->")
    dimension = spec.index(MODEL_AXIS)
    letter = kernel_letters[dimension]
    if letter in output and letter not in inputs:
        return LayerSplit(index, layer.kernel.path, dimension, False, gathers=True, axis=_axis(output, letter))
    if letter in inputs and letter not in output:
        return LayerSplit(index, layer.kernel.path, dimension, False, gathers=False, axis=_axis(inputs, letter))
    raise ValueError(
        f"{_where(layer.kernel, spec, mesh)}, but dimension {dimension} ({letter!r} in {layer.equation!r}) is "
        "in both the input and the output, which torch-dp does not split. Split a dimension the equation "
        "keeps in the output only, or one it sums over."
    )


def _axis(letters: str, letter: str) -> int:
    """The axis of ``letter`` in an einsum operand's ``letters`` (counted from the end after an ``...``)."""
    if "..." not in letters:
        return letters.index(letter)
    head, tail = letters.split("...")
    return head.index(letter) if letter in head else tail.index(letter) - len(tail)
