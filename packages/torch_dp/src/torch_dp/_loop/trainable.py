"""The caller's trainable choices, carried to a worker's rebuilt model: each layer's
``trainable``, each weight's own (``enable_lora`` freezes a kernel in a layer left trainable),
and which layers have LoRA enabled.

A rebuilt model need not list its layers as the caller's does: a layer created inside another's
``build`` (keras-hub's attention makes its softmax and dropout there) is no part of the saved
config and comes back under another automatic name, or not at all. So layers are matched by
their names from the model down (the top model's own name left out: a factory's model is named
anew in each process), and by their order only among the layers left unmatched; weights are
matched by position, as rank 0's state is broadcast, once their shapes and dtypes agree.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import keras

from dp_core.keras import internals


@dataclass(frozen=True)
class LayerFlag:
    key: str  # the names from the model down, "" for the model itself
    kind: str  # the layer's class name
    trainable: bool
    inherited: bool  # the same as its parent's: setting the parent's sets it
    lora: tuple[int, float] | None = None  # enable_lora's rank and alpha, where the caller enabled it


@dataclass(frozen=True)
class WeightFlag:
    path: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool


@dataclass(frozen=True)
class TrainableFlags:
    layers: tuple[LayerFlag, ...]
    weights: tuple[WeightFlag, ...]


def trainable_flags(model: keras.Model) -> TrainableFlags:
    """What the caller's (built) ``model`` trains: its layers' flags and its weights' own."""
    layers = []
    for key, layer, parent in _keyed_layers(model):
        inherited = parent is not None and parent.trainable == layer.trainable
        lora = (int(layer.lora_rank), float(layer.lora_alpha)) if getattr(layer, "lora_enabled", False) else None
        layers.append(LayerFlag(key, type(layer).__name__, bool(layer.trainable), inherited, lora))
    weights = tuple(WeightFlag(v.path, tuple(v.shape), str(v.dtype), bool(v.trainable)) for v in model.weights)
    return TrainableFlags(tuple(layers), weights)


def set_trainable(model: keras.Model, flags: TrainableFlags) -> None:
    """The caller's choices on the worker's ``model`` (made after a factory built it, say): LoRA
    where the caller enabled it (keras-hub's ``enable_lora`` reaches layers built inside others,
    which no config records), the layers' flags, parents before children (setting a layer's
    sets its sublayers'), then each weight's own. A model not built yet creates its weights
    under its layers' flags."""
    layers = [(key, layer) for key, layer, _ in _keyed_layers(model)]
    paired, unpaired = _paired(flags.layers, layers)
    if unpaired:
        described = ", ".join(f"'{flag.key}' ({flag.kind}, trainable={flag.trainable})" for flag in unpaired[:5])
        raise ValueError(
            f"torch_dp could not carry the caller's layer.trainable choices to '{model.name}' as a worker rebuilt "
            f"it: the rebuilt model has no layer matching {described} among its {len(layers)} layers (the "
            f"caller's has {len(flags.layers)}). Pass a zero-argument function that builds the model and sets "
            "these flags (trainer.fit(make_model, ...)), or set trainable on a layer whose config restores it."
        )
    for flag, layer in paired:
        if flag.lora is not None and layer.built and not getattr(layer, "lora_enabled", False):
            layer.enable_lora(flag.lora[0], lora_alpha=flag.lora[1])  # LoRA on a layer no config records
    for flag, layer in paired:
        if layer.trainable != flag.trainable:
            layer.trainable = flag.trainable
    weights = model.weights
    if not weights:
        return
    check_same_weights(model, flags.weights)
    for flag, variable in zip(flags.weights, weights, strict=True):
        if variable.trainable != flag.trainable:
            variable.trainable = flag.trainable


def _keyed_layers(model: keras.Model) -> list[tuple[str, keras.layers.Layer, keras.layers.Layer | None]]:
    """Every layer (``model`` first, then depth first) with its names from the model down and its parent."""
    found: list[tuple[str, keras.layers.Layer, keras.layers.Layer | None]] = []
    seen: set[int] = set()

    def visit(layer: keras.layers.Layer, key: str, parent: keras.layers.Layer | None) -> None:
        if id(layer) in seen:  # a layer used twice is listed once, as Keras flattens them
            return
        seen.add(id(layer))
        found.append((key, layer, parent))
        for child in internals.sublayers(layer):
            visit(child, f"{key}/{child.name}" if key else child.name, layer)

    visit(model, "", None)
    return found


def _paired(
    flags: tuple[LayerFlag, ...], layers: list[tuple[str, keras.layers.Layer]]
) -> tuple[list[tuple[LayerFlag, keras.layers.Layer]], list[LayerFlag]]:
    """Each caller's flag with its layer here: all by position when both list the same classes in
    the same order (a factory's model, an exact rebuild); else by names, then the rest by position
    when they list the same classes. Unpaired flags that their parent's setting does not carry
    come back as the second list."""
    if [flag.kind for flag in flags] == [type(layer).__name__ for _, layer in layers]:
        return [(flag, layer) for flag, (_, layer) in zip(flags, layers, strict=True)], []
    counts = Counter(key for key, _ in layers)
    by_key = {key: layer for key, layer in layers if counts[key] == 1}
    paired = [(flag, by_key[flag.key]) for flag in flags if type(by_key.get(flag.key)).__name__ == flag.kind]
    taken = {id(layer) for _, layer in paired}
    matched = {id(flag) for flag, _ in paired}
    rest_flags = [flag for flag in flags if id(flag) not in matched]
    rest_layers = [layer for _, layer in layers if id(layer) not in taken]
    if [flag.kind for flag in rest_flags] == [type(layer).__name__ for layer in rest_layers]:
        paired += zip(rest_flags, rest_layers, strict=True)
        rest_flags = []
    order = {id(flag): index for index, flag in enumerate(flags)}
    paired.sort(key=lambda pair: order[id(pair[0])])  # parents before children, as the caller lists them
    return paired, [flag for flag in rest_flags if not flag.inherited]


def check_same_weights(model: keras.Model, flags: tuple[WeightFlag, ...]) -> None:
    """The rebuilt ``model``'s weights are the caller's, in number, order, shapes and dtypes, or a
    clear error naming the first that differ."""
    weights = model.weights
    mine = [(tuple(v.shape), str(v.dtype)) for v in weights]
    if mine == [(flag.shape, flag.dtype) for flag in flags]:
        return
    differing = next(
        (i for i, (flag, here) in enumerate(zip(flags, mine, strict=False)) if (flag.shape, flag.dtype) != here),
        min(len(flags), len(mine)),
    )
    caller = f"'{flags[differing].path}' {flags[differing].shape}" if differing < len(flags) else "nothing more"
    rebuilt = f"'{weights[differing].path}' {mine[differing][0]}" if differing < len(mine) else "nothing more"
    raise ValueError(
        f"torch_dp: the model '{model.name}' a worker rebuilt has other weights than the caller's: "
        f"{len(mine)} there against {len(flags)} here, and weight {differing} is {caller} here but {rebuilt} there. "
        "A model factory must build the same model each time it is called; a model object is rebuilt from "
        "model.save(), so what its config does not record (weights added after it was built, as enable_lora "
        "adds to layers built inside another) is lost. Pass a zero-argument function that builds the model "
        "as you do (trainer.fit(make_model, ...))."
    )
