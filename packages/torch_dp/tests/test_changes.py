"""What rank 0 notes as changed by its callbacks (``_loop.changes``): every assignment, a layer's
``trainable``, optimizer variables; not the learning rate, the random streams or a step's own metrics."""

import types

import keras
import numpy as np

from torch_dp._loop.changes import Changes, shared_variables
from torch_dp._loop.trainable import trainable_flags

RANK_0 = types.SimpleNamespace(is_primary=True, distributed=True, rank=0, num_replicas=2)


def _model(**optimizer):
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dropout(0.5), keras.layers.Dense(2)]
    )
    model.compile(keras.optimizers.SGD(0.1, **optimizer), "mse")
    model.optimizer.build(model.trainable_variables)
    return model


def _marked(model, **options):
    changes = Changes(model, RANK_0, **options)
    changes.mark()
    assert not changes.seen()
    return changes


def test_an_assigned_weight_and_an_optimizer_variable_are_changes():
    model = _model(use_ema=True)
    changes = _marked(model)
    kernel = model.layers[0].kernel
    kernel.assign(kernel)  # the same values, assigned: a callback's write, seen as one
    assert changes.seen()
    changes = _marked(model)
    average = model.optimizer._model_variables_moving_average[0]
    average.assign(average * 2.0)
    assert changes.seen()


def test_the_optimizer_is_not_watched_for_an_evaluation():
    model = _model(use_ema=True)
    changes = _marked(model, optimizer=False)
    model.optimizer.iterations.assign(5)
    assert not changes.seen()


def test_a_layers_trainable_is_a_change():
    model = _model()
    changes = _marked(model)
    model.layers[0].trainable = False
    assert changes.seen()
    # what share sends when that happens: the flags by layer name, and each weight's own
    flags, frozen = trainable_flags(model), model.layers[0]
    assert [flag.trainable for flag in flags.layers if flag.key == frozen.name] == [False]
    frozen_weights = {id(weight) for weight in frozen.weights}  # its kernel and bias
    weights = zip(flags.weights, model.weights, strict=True)
    assert [flag.trainable for flag, weight in weights if id(weight) in frozen_weights] == [False, False]


def test_the_learning_rate_and_the_random_streams_are_not_changes():
    model = _model()
    changes = _marked(model)
    model.optimizer.learning_rate.assign(0.01)  # rank 0's decisions carry it
    model(np.ones((2, 3), "float32"), training=True)  # the dropout layer's seed moves on every replica
    assert not changes.seen()
    seeds = {id(model.layers[1].seed_generator.state)}  # the dropout layer's
    assert not seeds & {id(v) for v in shared_variables(model, optimizer=True)}


def test_other_replicas_and_one_replica_never_see_a_change():
    model = _model()
    for replica in (
        types.SimpleNamespace(is_primary=False, distributed=True),
        types.SimpleNamespace(is_primary=True, distributed=False),
    ):
        changes = Changes(model, replica)
        changes.mark()
        model.layers[0].kernel.assign(model.layers[0].kernel * 2.0)
        assert not changes.seen()
