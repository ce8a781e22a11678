"""check_equivalence's backend-neutral half: the data both runs read, the models they start
from, the causes a model has by design, the per-layer comparison, and the command line
(driven by a stand-in check, so nothing trains here)."""

from __future__ import annotations

import pickle
import re
import textwrap

import keras
import numpy as np
import pytest

from dp_core import EquivalenceReport, padded_batch_size
from dp_core.keras import run_check_command
from dp_core.keras._equivalence import (
    FirstItems,
    StartingFrom,
    compare_replica_counts,
    first_steps,
    known_causes,
    nudged,
    starting_models,
    weight_differences,
)


def dense_model(*layers, dtype=None):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, dtype=dtype), *layers, keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def dropout_model():
    return dense_model(keras.layers.Dropout(0.5))


def data(rows=20):
    x = np.arange(rows * 4, dtype="float32").reshape(rows, 4) / 10
    return x, np.ones((rows, 2), "float32")


def test_arrays_are_cut_to_the_first_steps_global_batches_in_order():
    x, y = data(20)
    cut_x, cut_y, steps_per_epoch = first_steps({"a": x}, y, global_batch_size=4, steps=3)
    np.testing.assert_array_equal(cut_x["a"], x[:12])
    np.testing.assert_array_equal(cut_y, y[:12])
    assert steps_per_epoch is None  # the cut arrays are the whole epoch
    short_x, _, _ = first_steps(x, y, global_batch_size=8, steps=5)
    assert len(short_x) == 20  # fewer rows than asked: all of them


def test_a_dataset_is_cut_to_its_first_items_and_a_batch_source_keeps_its_steps():
    items = [(np.full(4, i, "float32"), np.zeros(2, "float32")) for i in range(10)]
    cut, _, _ = first_steps(items_dataset := ItemList(items), None, global_batch_size=2, steps=3)
    assert isinstance(cut, FirstItems) and len(cut) == 6
    assert cut[5][0][0] == 5 and cut[-1][0][0] == 5
    with pytest.raises(IndexError):
        cut[6]
    assert first_steps(items_dataset, None, global_batch_size=5, steps=2)[0] is items_dataset

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return data(2)

    source = Batches()
    assert first_steps(source, None, global_batch_size=2, steps=3) == (source, None, 3)


def test_an_iterator_is_refused_because_both_runs_read_the_data():
    with pytest.raises(ValueError, match="x is an iterator .*can be read once"):
        first_steps(iter([data(2)]), None, global_batch_size=2, steps=1)


class ItemList:
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


def test_a_model_is_copied_twice_with_its_weights_and_seed_states_and_left_untouched():
    model = dropout_model()
    original = [w.copy() for w in model.get_weights()]
    first, second = starting_models(model, *data())
    assert first is not model and second is not model
    for mine, copy_a, copy_b in zip(model.get_weights(), first.get_weights(), second.get_weights(), strict=True):
        np.testing.assert_array_equal(copy_a, mine)
        np.testing.assert_array_equal(copy_b, mine)
    states = [m.layers[1].seed_generator.state.numpy() for m in (model, first, second)]
    np.testing.assert_array_equal(states[1], states[0])  # clone_model alone draws a fresh seed
    np.testing.assert_array_equal(states[2], states[0])
    assert first.optimizer is not model.optimizer  # compiled like it, with its own optimizer
    assert first.optimizer.get_config() == model.optimizer.get_config()
    assert first.loss == model.loss == "mse"
    for now, before in zip(model.get_weights(), original, strict=True):
        np.testing.assert_array_equal(now, before)


def test_a_factory_builds_the_first_model_and_a_picklable_factory_starting_where_it_does():
    first, second = starting_models(dropout_model, *data())
    assert isinstance(second, StartingFrom)
    rebuilt = pickle.loads(pickle.dumps(second))()  # as a torch-dp worker process calls it
    for mine, theirs in zip(first.get_weights(), rebuilt.get_weights(), strict=True):
        np.testing.assert_array_equal(theirs, mine)
    seeds = [m.layers[1].seed_generator.state.numpy() for m in (first, rebuilt)]
    np.testing.assert_array_equal(seeds[1], seeds[0])


def test_a_model_without_an_input_is_built_from_the_first_rows_before_its_weights_are_read():
    def unbuilt():
        model = keras.Sequential([keras.layers.Dense(3), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    first, second = starting_models(unbuilt, *data())
    assert [w.shape for w in first.get_weights()] == [(4, 3), (3,), (3, 2), (2,)]
    np.testing.assert_array_equal(second().get_weights()[0], first.get_weights()[0])


def test_an_uncompiled_model_is_refused_before_anything_is_copied():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="is not compiled"):
        starting_models(model, *data())


def test_differences_are_per_layer_matched_by_position():
    model_a, model_b = dense_model(), dense_model()  # a factory names its layers anew
    model_b.set_weights(model_a.get_weights())
    kernel = model_b.layers[1].kernel
    kernel.assign(kernel.value * 1.5)
    differences = weight_differences(model_a, model_b)
    assert list(differences) == [layer.name for layer in model_a.layers]
    assert differences[model_a.layers[0].name] == 0.0
    assert differences[model_a.layers[1].name] == pytest.approx(0.5, rel=1e-6)


def test_known_causes_name_the_layers_that_differ_by_design():
    assert known_causes(dropout_model(), batch_norm="global") == ()  # every replica draws the global batch's noise

    with_batch_norm = dense_model(keras.layers.BatchNormalization(name="bn"))
    assert known_causes(with_batch_norm, batch_norm="global") == ()
    [normalizing] = known_causes(with_batch_norm, batch_norm="per_replica")
    assert normalizing.startswith('batch_norm="per_replica": BatchNormalization layers (bn)')

    [mixed] = known_causes(dense_model(dtype="mixed_bfloat16"), batch_norm="global")
    assert mixed.startswith("mixed precision (mixed_bfloat16): sums in bfloat16")
    assert known_causes(dense_model(), batch_norm="per_replica") == ()


def test_nudged_moves_each_float_element_by_2_to_the_minus_20_up_or_down_and_leaves_ids_alone():
    x = {"pixels": np.ones((50, 4), "float32"), "ids": np.arange(50).reshape(50, 1)}
    moved = nudged(x)
    np.testing.assert_array_equal(moved["ids"], x["ids"])
    assert moved["pixels"].dtype == np.float32
    assert set(np.unique(moved["pixels"] - 1.0).tolist()) == {-(2.0**-20), 2.0**-20}  # both ways, exactly
    np.testing.assert_array_equal(nudged(x)["pixels"], moved["pixels"])  # the same pattern each time


def test_nudged_refuses_data_it_cannot_multiply_saying_what_to_pass():
    with pytest.raises(ValueError, match="needs x as arrays .* got FirstItems"):
        nudged(FirstItems([(np.zeros(2), 0)] * 4, 2))
    with pytest.raises(ValueError, match="x holds no float arrays"):
        nudged(np.arange(8).reshape(4, 2))


def test_the_rounding_baseline_trains_a_third_copy_on_one_replica_on_nudged_inputs():
    calls = []

    def train(num_replicas, model, *, x, y, global_batch_size, seed, **arguments):
        calls.append((num_replicas, x.copy()))
        return model.fit(x, y, batch_size=global_batch_size, **arguments)

    x, y = data(16)
    model = dense_model()
    common = {"global_batch_size": 4, "steps": 2}
    report = compare_replica_counts(train, model, x, y, rounding_baseline=True, **common)
    assert [replicas for replicas, _ in calls] == [1, 2, 1]
    np.testing.assert_array_equal(calls[1][1], x[:8])
    np.testing.assert_array_equal(calls[2][1], nudged(x[:8]))
    # the stand-in trains 2 replicas as 1: identical weights, and the nudged run moved every layer
    assert set(report.layer_differences.values()) == {0.0}
    assert list(report.baseline_differences) == list(report.layer_differences)
    assert all(0 < moved < 1e-4 for moved in report.baseline_differences.values())
    assert len(report.baseline_losses) == 2 and report.baseline_losses != report.losses
    assert compare_replica_counts(train, model, x, y, **common).baseline_differences is None
    assert len(calls) == 5  # without it, two runs


def test_a_global_batch_that_does_not_divide_is_compared_as_given():
    calls = []

    def train(num_replicas, model, *, x, y, global_batch_size, seed, **arguments):
        calls.append((num_replicas, global_batch_size, len(x)))
        return model.fit(x, y, batch_size=global_batch_size, **arguments)

    x, y = data(16)
    report = compare_replica_counts(train, dense_model(), x, y, global_batch_size=5, steps=3, num_replicas=2)
    assert calls == [(1, 5, 15), (2, 5, 15)]  # the trainers pad 5 rows on 2 replicas to 6 themselves
    assert (report.global_batch_size, report.num_replicas) == (5, 2)
    assert len(report.losses) == 3 and set(report.layer_differences.values()) == {0.0}


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module the command line imports by name, as a user's would be."""
    (tmp_path / "user_code.py").write_text(
        textwrap.dedent(
            """
            import numpy as np

            def make_model():
                return "a model"

            def data():
                return np.zeros((8, 4)), np.zeros(8)

            def three():
                return 1, 2, 3

            class models:
                exact = make_model
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))


def stand_in(max_difference, calls):
    def check(model, x, y, **options):
        padded_batch_size(options["global_batch_size"], options["num_replicas"])  # as the real check does
        calls.append((model, x.shape, y.shape, options))
        return EquivalenceReport(
            options["num_replicas"], options["global_batch_size"], {"dense": max_difference}, (), ()
        )

    return check


def test_the_command_exits_0_when_equivalent_and_1_when_not(user_module, capsys):
    calls = []
    argv = ["user_code:models.exact", "--data", "user_code:data", "--global-batch-size", "4", "--replicas", "4"]
    assert run_check_command(stand_in(1e-7, calls), argv, prog="check") == 0
    assert "Verdict: equivalent within float32 rounding" in capsys.readouterr().out
    model, x_shape, y_shape, options = calls[0]
    assert (model(), x_shape, y_shape) == ("a model", (8, 4), (8,))
    assert options == {
        "global_batch_size": 4,
        "steps": 5,
        "num_replicas": 4,
        "tolerance": 1e-5,
        "seed": 0,
        "batch_norm": "global",
        "rounding_baseline": False,
        "verbose": False,
    }
    assert run_check_command(stand_in(1e-3, calls), [*argv, "--tolerance", "1e-4"], prog="check") == 1
    assert "Verdict: NOT equivalent" in capsys.readouterr().out
    assert calls[1][3]["tolerance"] == 1e-4
    run_check_command(stand_in(1e-7, calls), [*argv, "--rounding-baseline"], prog="check")
    assert calls[2][3]["rounding_baseline"] is True


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["user_code", "--data", "user_code:data"], "the model: expected module:name"),
        (["no_such_module:f", "--data", "user_code:data"], "cannot import module 'no_such_module'"),
        (["user_code:missing", "--data", "user_code:data"], "has no attribute 'missing'"),
        (["user_code:make_model", "--data", "user_code:three"], r"returned a tuple; expected a tuple \(x, y\)"),
        (["user_code:make_model", "--data", "user_code:data", "--steps", "0"], "expected a positive integer, got 0"),
        (["user_code:make_model", "--data", "user_code:data", "--tolerance", "x"], "expected a number >= 0"),
        (["user_code:make_model"], "the following arguments are required: --data"),
    ],
)
def test_bad_arguments_exit_2_saying_what_is_wrong(user_module, capsys, arguments, message):
    calls = []
    with pytest.raises(SystemExit) as exited:
        run_check_command(stand_in(0.0, calls), arguments, prog="check")
    assert exited.value.code == 2
    assert calls == []
    assert re.search(message, capsys.readouterr().err)
