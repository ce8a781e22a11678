"""``Trainer(shard=...)``: ZeRO-1/2/3 sharded state trains exactly as single-device ``model.fit``.

Each mode on 2 or 4 replicas, with a spread of optimizers (SGD with momentum, Adam with a clipping
global norm and EMA, AdamW under mixed precision, Adam accumulating gradients, optax), gives
``model.fit``'s weights, History, evaluate and predict on an Embedding + Dense +
BatchNormalization model with an uneven last batch; the large variables' slots (and in "full"
their weights) lie split over "batch" while the small ones stay replicated; "gradients"
constrains the gradients to the slots' split; checkpoints of one mode resume in another, on
another replica count; a layout's "model" split and "batch" combine on a 2-D mesh.

The model is tiny, so the split threshold is lowered to 16 elements for this module.
"""

from __future__ import annotations

import functools
import re
import shutil
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import keras
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from jax_dp_helpers import GLOBAL_BATCH, NUM_SAMPLES, Run, assert_same_run, keras_run

import dp_core
import jax_dp
from dp_core.keras import build_model, checked_call
from jax_dp._data.batches import device_batches
from jax_dp._data.sources import epoch_plan
from jax_dp._loop import epochs as _epochs
from jax_dp._mesh import layout as _layout
from jax_dp._step.compile_cache import CompileCache
from jax_dp._step.hlo import all_reduces
from jax_dp._step.optimizers import KerasOptimizer
from jax_dp._step.recipes import Recipes
from jax_dp._step.state import TrainState, train_state_on_mesh
from jax_dp._step.steps import make_train_step

EPOCHS = 2
SEED = 3
FLOAT16 = {"atol": 5e-3, "rtol": 1e-2}  # float16 compute: its rounding, not the replicas, sets the noise
# With the threshold at 16 elements: split (4 replicas: the largest dimension that divides by 4)...
LARGE = {
    "embedding/embeddings": P("batch", None),
    "dense_in/kernel": P(None, "batch"),  # 17 rows do not divide: the 8 columns do
    "dense_out/kernel": P("batch", None),
}
SMALL = ("batch_normalization/gamma", "batch_normalization/beta", "dense_out/bias")  # ...and replicated


@pytest.fixture(scope="module", autouse=True)
def small_threshold() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_layout, "SHARD_MIN_ELEMENTS", 16)
        yield


def build(optimizer: Callable[[], Any] = lambda: keras.optimizers.Adam(0.01)) -> keras.Model:
    keras.utils.set_random_seed(2)
    numbers = keras.Input((5,), name="numbers")
    tokens = keras.Input((3,), dtype="int32", name="tokens")
    embedded = keras.layers.Flatten()(keras.layers.Embedding(8, 4, name="embedding")(tokens))
    hidden = keras.layers.Dense(8, use_bias=False, name="dense_in")(keras.layers.Concatenate()([numbers, embedded]))
    hidden = keras.layers.Activation("relu")(keras.layers.BatchNormalization(name="batch_normalization")(hidden))
    model = keras.Model([numbers, tokens], keras.layers.Dense(4, name="dense_out", dtype="float32")(hidden))
    model.compile(optimizer=optimizer(), loss="mse", metrics=["mae"])
    return model


class Case(NamedTuple):
    shard: str
    num_replicas: int
    keras_optimizer: Callable[[], Any]  # the model's, and single-device model.fit's
    optax_optimizer: Callable[[], Any] | None = None  # the trainer's instead, where given
    mixed_float16: bool = False
    shuffle: bool = True  # False: one model.fit over every epoch (EMA replaces the weights when a fit ends)


def sgd() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.1, momentum=0.9)


def adam() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(0.01)


CASES = {
    "optimizer-sgd-momentum": Case("optimizer", 4, sgd),
    "optimizer-adam-clipnorm-ema": Case(
        "optimizer", 2, lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05, use_ema=True), shuffle=False
    ),
    "gradients-adamw-mixed-float16": Case("gradients", 2, lambda: keras.optimizers.AdamW(0.01), mixed_float16=True),
    "gradients-adam-accumulating": Case(
        "gradients", 4, lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=2)
    ),
    "full-adam": Case("full", 4, adam),
    "full-optax-sgd-momentum": Case("full", 2, sgd, optax_optimizer=lambda: optax.sgd(0.1, momentum=0.9)),
}


@pytest.fixture(scope="module")
def inputs() -> tuple[list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(5)
    x = [rng.normal(size=(NUM_SAMPLES, 5)).astype("float32"), rng.integers(0, 8, (NUM_SAMPLES, 3)).astype("int32")]
    return x, rng.normal(size=(NUM_SAMPLES, 4)).astype("float32")


def mixed_precision(on: bool) -> Any:
    """The ``mixed_float16`` policy while models are built (restored after), else nothing."""
    import contextlib

    @contextlib.contextmanager
    def policy() -> Iterator[None]:
        before = keras.mixed_precision.dtype_policy()
        keras.mixed_precision.set_dtype_policy("mixed_float16")
        try:
            yield
        finally:
            keras.mixed_precision.set_dtype_policy(before)

    return policy() if on else contextlib.nullcontext()


@pytest.fixture(scope="module")
def single_device(inputs) -> Callable[..., tuple[Run, list[np.ndarray]]]:
    """Single-device ``model.fit`` (then evaluate, predict) with an optimizer, once per module."""

    x, y = inputs

    @functools.cache
    def run(optimizer: Callable[[], Any], mixed_float16: bool = False, shuffle: bool = True) -> tuple[Run, list[Any]]:
        with mixed_precision(mixed_float16):
            if shuffle:  # one model.fit per epoch, on the trainer's order of the rows
                return keras_run(lambda: build(optimizer), x, y, epochs=EPOCHS, seed=SEED)
            model = build(optimizer)
            initial = model.get_weights()
            history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
            evaluation = model.evaluate(x, y, batch_size=GLOBAL_BATCH, return_dict=True, verbose=0)
            return Run(model, history, evaluation, model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)), initial

    return run


class ShardedRun(NamedTuple):
    run: Run
    state: TrainState  # the state the jitted steps left on the mesh at the last epoch's end
    expected: Run


@pytest.fixture(scope="module")
def sharded(inputs, single_device) -> Callable[[str], ShardedRun]:
    """Each case's run (once per module) with the single-device run it must equal."""
    x, y = inputs

    @functools.cache
    def run(name: str) -> ShardedRun:
        case = CASES[name]
        expected, initial = single_device(case.keras_optimizer, case.mixed_float16, case.shuffle)
        states: list[TrainState] = []
        write_back = _epochs.write_back
        with pytest.MonkeyPatch.context() as patch, mixed_precision(case.mixed_float16):
            patch.setattr(_epochs, "write_back", lambda m, o, s, **k: states.append(s) or write_back(m, o, s, **k))
            model = build(case.keras_optimizer)
            model.set_weights(initial)
            optimizer = None if case.optax_optimizer is None else case.optax_optimizer()
            trainer = jax_dp.Trainer(case.num_replicas, shard=case.shard, optimizer=optimizer)  # type: ignore[arg-type]
            history = trainer.fit(
                model, x, y, global_batch_size=GLOBAL_BATCH, epochs=EPOCHS, seed=SEED, shuffle=case.shuffle, verbose=0
            )
            evaluation = trainer.evaluate(model, x, y, global_batch_size=GLOBAL_BATCH, return_dict=True, verbose=0)
            predictions = trainer.predict(model, x, global_batch_size=GLOBAL_BATCH, verbose=0)
        return ShardedRun(Run(model, history.history, evaluation, predictions), states[-1], expected)

    return run


def short(path: str) -> str:
    """A variable's path or slot's name without the model's name (which older Keras puts first)."""
    return path.removeprefix("functional/").removeprefix("functional_")


@pytest.mark.parametrize("name", list(CASES))
def test_every_mode_trains_evaluates_and_predicts_as_one_device(sharded, name):
    case, result = CASES[name], sharded(name)
    assert_same_run(result.expected, result.run, **({"atol": FLOAT16["atol"]} if case.mixed_float16 else {}))
    if case.mixed_float16:  # the loss-scaling optimizer ran, its slots split too
        assert isinstance(result.run.model.optimizer, keras.optimizers.LossScaleOptimizer)
        _, slots = placements(result.run.model, result.state)
        assert_split(slots["dense_in_kernel_velocity"], LARGE["dense_in/kernel"], 2)


def test_the_clipping_norm_clips(inputs):
    """The global norm of the first step's gradient is far above 0.05: the clipping case clips."""
    model = build()
    x, y = inputs

    def loss(trainable: list[Any]) -> Any:
        batch = [part[:GLOBAL_BATCH] for part in x]
        y_pred, _ = model.stateless_call(
            trainable, [v.value for v in model.non_trainable_variables], batch, training=True
        )
        return keras.ops.mean(keras.ops.square(y_pred - y[:GLOBAL_BATCH]))

    gradients = jax.grad(loss)([v.value for v in model.trainable_variables])
    assert float(np.sqrt(sum(np.sum(np.square(g)) for g in gradients))) > 0.5


def placements(model: keras.Model, state: TrainState) -> tuple[dict[str, Any], dict[str, Any]]:
    """The trainable weights' arrays by path, and the Keras optimizer's by slot name."""
    weights = {short(v.path): a for v, a in zip(model.trainable_variables, state.trainable, strict=True)}
    slots = {short(v.name): a for v, a in zip(model.optimizer.variables, state.optimizer, strict=True)}
    return weights, slots


def assert_split(array: jax.Array, spec: P, num_replicas: int) -> None:
    assert array.sharding.spec == spec
    dimension = list(spec).index("batch")
    assert array.addressable_shards[0].data.shape[dimension] == array.shape[dimension] // num_replicas


def test_optimizer_mode_splits_the_large_variables_slots_and_keeps_the_weights_whole(sharded):
    result = sharded("optimizer-sgd-momentum")
    weights, slots = placements(result.run.model, result.state)
    for path, spec in LARGE.items():
        assert_split(slots[path.replace("/", "_") + "_momentum"], spec, 4)
        assert weights[path].sharding.is_fully_replicated
    for path in SMALL:
        assert slots[path.replace("/", "_") + "_momentum"].sharding.is_fully_replicated
    assert slots["iteration"].sharding.is_fully_replicated


def test_accumulating_gradients_mode_splits_the_accumulators_too(sharded):
    result = sharded("gradients-adam-accumulating")
    _, slots = placements(result.run.model, result.state)
    for path, spec in LARGE.items():
        for slot in ("momentum", "velocity", "gradient_accumulator"):
            assert_split(slots[f"{path.replace('/', '_')}_{slot}"], spec, 4)
    # the per-replica partial sums: one whole sum per replica (see _step.accumulation)
    kernel = [short(v.path) for v in result.run.model.trainable_variables].index("dense_in/kernel")
    assert result.state.accumulated[kernel].addressable_shards[0].data.shape == (1, 17, 8)


def test_full_mode_splits_the_large_weights_and_their_slots(sharded):
    result = sharded("full-adam")
    weights, slots = placements(result.run.model, result.state)
    for path, spec in LARGE.items():
        assert_split(weights[path], spec, 4)
        assert_split(slots[path.replace("/", "_") + "_velocity"], spec, 4)
    for path in SMALL:
        assert weights[path].sharding.is_fully_replicated


def test_full_mode_splits_an_optax_state_like_its_parameters(sharded):
    result = sharded("full-optax-sgd-momentum")
    paths = [short(v.path) for v in result.run.model.trainable_variables]
    trace = result.state.optimizer[0].trace  # optax.TraceState: the momentum per parameter
    for path, spec in LARGE.items():  # the same dimensions divide by 2
        assert_split(trace[paths.index(path)], spec, 2)
        assert_split(result.state.trainable[paths.index(path)], spec, 2)
    assert trace[paths.index("dense_out/bias")].sharding.is_fully_replicated


def compiled_step(inputs, shard: str | None) -> tuple[str, str]:
    """A 2-replica SGD train step in mode ``shard``: the lowered module (before XLA partitions it)
    and the compiled one, as text."""
    trainer = jax_dp.Trainer(2, shard=shard)  # type: ignore[arg-type]
    model, batches, _, _ = checked_call(
        build(sgd), *inputs, batch_size=None, global_batch_size=GLOBAL_BATCH, step_names=("train_step",),
        checks=trainer._call_checks,
    )  # fmt: skip
    build_model(model, batches)
    placement = _layout.place(model, trainer.mesh, trainer.variable_layout, trainer.shard)
    optimizer = KerasOptimizer(model)
    step = make_train_step(model, optimizer, placement, batch_norm="global", skip_nonfinite=False)
    state = train_state_on_mesh(model, optimizer, placement, previous_optimizer_state=None, metric_sums=None)
    plan = epoch_plan(batches, layout=trainer.layout, order=dp_core.EpochOrder.in_input_order(32))
    batch = next(iter(device_batches(plan, trainer.mesh)))
    lowered = step.lower(state, batch, True)
    return lowered.as_text(), lowered.compile().as_text()


def split_constraints(lowered: str) -> list[str]:
    """The array types a lowered module constrains to a split over "batch" (Shardy's
    ``sdy.sharding_constraint``, or GSPMD's ``@Sharding`` custom call with a tiled ``devices=``)."""
    shardy = re.findall(r"sharding_constraint %\S+ <@mesh, \[[^\]]*\"batch\"[^\]]*\]> : tensor<(\w+)>", lowered)
    gspmd = re.findall(r"@Sharding\(.*mhlo.sharding = \"\{devices=\[[\d,]*2[\d,]*\].*-> tensor<(\w+)>", lowered)
    return shardy + gspmd


def test_gradients_mode_reduce_scatters_and_optimizer_mode_gathers_the_weights(inputs):
    kernel_gradient, kernel_half = "f32[8,17]", re.compile(r"f32\[(4,17|17,4)\]\S* dynamic-slice\(")

    gradients_lowered, gradients_compiled = compiled_step(inputs, "gradients")
    # each large gradient is put where its slots lie: 8x4 (embedding), 17x8 (dense_in), 8x4 (dense_out)
    assert sorted(split_constraints(gradients_lowered)) == ["17x8xf32", "8x4xf32", "8x4xf32"]
    # XLA sums each device's part: a reduce-scatter, or on the CPU backend (whose pipeline has no
    # reduce-scatter pass) the all-reduce of the whole gradient followed by each device's slice
    summed = [r for r in all_reduces(gradients_compiled) if kernel_gradient in r.shapes]
    assert "reduce-scatter" in gradients_compiled or (summed and kernel_half.search(gradients_compiled))

    optimizer_lowered, optimizer_compiled = compiled_step(inputs, "optimizer")
    assert not split_constraints(optimizer_lowered)  # the gradients lie where XLA puts them
    # each device updates its part of the weight; the new weights are all-gathered (replicated)
    assert re.search(r"all-gather(-start)?\(", optimizer_compiled)
    assert re.search(r"f32\[17,8\]\S* all-gather", optimizer_compiled)

    _, unsharded = compiled_step(inputs, None)
    assert "all-gather" not in unsharded and "reduce-scatter" not in unsharded


def test_the_compile_cache_keys_on_the_shard_mode(inputs):
    model = build()
    build_model(model, checked_call(model, *inputs, batch_size=None, global_batch_size=32, step_names=("train_step",),
                                    checks=jax_dp.Trainer(2)._call_checks)[1])  # fmt: skip
    cache, mesh, optimizer = CompileCache(), jax_dp.Trainer(2).mesh, KerasOptimizer(model)

    def train_step(shard: str | None) -> Any:
        placement = _layout.Placement(mesh, _layout.Layout(), shard)  # type: ignore[arg-type]
        recipes = Recipes(cache, placement, batch_norm="global", skip_nonfinite=False)
        return recipes.steps(model, optimizer).train

    unsharded = train_step(None)
    assert train_step(None) is unsharded
    assert train_step("full") is not unsharded


def test_checkpoints_resume_in_another_mode_and_replica_count(inputs, single_device, sharded, tmp_path):
    x, y = inputs
    full = sharded("full-adam")  # shard="full" on 4 replicas, uninterrupted
    expected, initial = single_device(adam)

    def fit(shard: str | None, num_replicas: int, epochs: int, folder: Any) -> keras.Model:
        model = build()
        model.set_weights(initial)
        jax_dp.Trainer(num_replicas, shard=shard).fit(  # type: ignore[arg-type]
            model, x, y, global_batch_size=GLOBAL_BATCH, epochs=epochs, seed=SEED, checkpoint_dir=str(folder),
            verbose=0,
        )  # fmt: skip
        return model

    fit("full", 4, 1, tmp_path / "a")
    checkpoint = dp_core.latest_checkpoint(tmp_path / "a")
    assert checkpoint is not None and checkpoint.epoch == 1
    assert [w.shape for w in checkpoint.weights] == [w.shape for w in expected.model.get_weights()]  # whole arrays
    shutil.copytree(tmp_path / "a", tmp_path / "b")

    unsharded = fit(None, 2, EPOCHS, tmp_path / "a")
    for variable, want, got in zip(
        unsharded.weights, expected.model.get_weights(), unsharded.get_weights(), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=variable.path)

    same_mode = fit("full", 4, EPOCHS, tmp_path / "b")
    for variable, want, got in zip(
        same_mode.weights, full.run.model.get_weights(), same_mode.get_weights(), strict=True
    ):
        np.testing.assert_array_equal(got, want, err_msg=variable.path)


def test_a_layouts_model_split_and_the_batch_split_combine_on_a_2d_mesh(inputs, single_device, monkeypatch):
    x, y = inputs
    expected, initial = single_device(adam)
    states: list[TrainState] = []
    write_back = _epochs.write_back
    monkeypatch.setattr(_epochs, "write_back", lambda m, o, s, **k: states.append(s) or write_back(m, o, s, **k))
    layout = {"embedding": (None, "model"), "dense_in/kernel": (None, "model"), "dense_out/kernel": ("model", None)}
    model = build()
    model.set_weights(initial)
    trainer = jax_dp.Trainer(mesh=jax.make_mesh((2, 2), ("batch", "model")), layout=layout, shard="full")
    history = trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, epochs=EPOCHS, seed=SEED, verbose=0)
    evaluation = trainer.evaluate(model, x, y, global_batch_size=GLOBAL_BATCH, return_dict=True, verbose=0)
    predictions = trainer.predict(model, x, global_batch_size=GLOBAL_BATCH, verbose=0)
    assert_same_run(expected, Run(model, history.history, evaluation, predictions))

    weights, slots = placements(model, states[-1])
    assert weights["embedding/embeddings"].sharding.spec == P("batch", "model")
    assert weights["dense_out/kernel"].sharding.spec == P("model", "batch")
    assert weights["dense_in/kernel"].sharding.spec == P(None, "model")  # 17 rows do not divide over 2
    assert slots["dense_out_kernel_momentum"].sharding.spec == P("model", "batch")
    assert weights["dense_out/kernel"].addressable_shards[0].data.shape == (4, 2)


def test_a_bad_shard_mode_or_a_models_own_train_step_is_refused(inputs):
    with pytest.raises(
        ValueError, match=r"shard must be one of \(None, 'optimizer', 'gradients', 'full'\), got 'zero3'"
    ):
        jax_dp.Trainer(2, shard="zero3")  # type: ignore[arg-type]

    class OwnStep(keras.Model):
        def train_step(self, state, data):  # never runs: refused before training
            raise AssertionError

    numbers = keras.Input((5,), name="numbers")
    tokens = keras.Input((3,), dtype="int32", name="tokens")
    model = OwnStep([numbers, tokens], keras.layers.Dense(4)(numbers))
    model.compile(optimizer="sgd", loss="mse")
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"overrides train_step.*shard='optimizer' needs Keras's own steps"):
        jax_dp.Trainer(2, shard="optimizer").fit(model, *inputs, global_batch_size=GLOBAL_BATCH, verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before, strict=True))
