"""A model Keras's own format cannot rebuild in a worker (no ``get_config``, a layer's ``__init__``
without ``**kwargs``, a layer made a model, a layer with Keras's Trainer mixed in) travels by value
and trains as ``model.fit`` trains it; one that cannot travel at all is refused in the caller,
naming the layer and why."""

import keras
import numpy as np
import pytest
import torch_dp_testing as testing

from torch_dp._processes.transfer import ship_model

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
KINDS = ["no_config", "no_kwargs", "dense_as_model", "layer_with_trainer"]


def model_of(kind):
    """A compiled model of ``kind``; ``layer_with_trainer`` is Keras's trainer_test.py model as it is."""
    return (
        testing.layer_with_keras_trainer() if kind == "layer_with_trainer" else testing.model_keras_cannot_rebuild(kind)
    )


def keras_round_trip_error(model, path):
    """What Keras raises saving ``model`` and loading it back (None: it comes back)."""
    try:
        model.save(path)
        keras.saving.load_model(path)
    except Exception as error:
        return error
    return None


@pytest.mark.parametrize("kind", KINDS)
def test_keras_cannot_rebuild_it_so_it_goes_by_value(kind, tmp_path):
    model = model_of(kind)
    assert keras_round_trip_error(model, tmp_path / "model.keras") is not None
    source = ship_model(model, model, str(tmp_path), trains=True)
    assert source.pickled is not None and source.factory is None


def test_a_model_that_cannot_travel_names_the_layer_and_why(tmp_path):
    model = testing.model_keras_cannot_rebuild("locked")
    keras_said = r"'sequential.*unexpected keyword argument 'trainable'"  # Keras's own reason, its last line
    pickle_said = r"by value \(cloudpickle\) failed too: holds_a_lock\.lock cannot be pickled \(TypeError: cannot"
    with pytest.raises(TypeError, match=f"{keras_said}.*{pickle_said}"):
        ship_model(model, model, str(tmp_path), trains=True)


@pytest.mark.parametrize("kind", KINDS)
def test_it_trains_evaluates_and_predicts_as_model_fit(two_replicas, kind):
    x, y = testing.data()
    reference = model_of(kind)
    expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model = model_of(kind)
    history = two_replicas.fit(model, x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, atol=1e-6, err_msg=name)
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=5e-6)
    np.testing.assert_allclose(
        two_replicas.evaluate(model, x, y, batch_size=32, verbose=0), reference.evaluate(x, y, verbose=0), rtol=1e-5
    )
    np.testing.assert_allclose(two_replicas.predict(model, x, verbose=0), reference.predict(x, verbose=0), atol=1e-6)
