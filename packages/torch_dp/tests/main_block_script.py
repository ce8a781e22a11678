"""Run as a script: everything is defined under the main guard, as users write it (and as a
notebook cell defines it): a custom layer, a model object using it, a model factory, a callback
class. Prints one JSON line comparing the Trainer with Keras and showing the callbacks' state."""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "torch"

if __name__ == "__main__":
    import keras
    import numpy as np

    import torch_dp

    class Doubled(keras.layers.Layer):  # not registered, not importable by a worker
        def call(self, inputs):
            return inputs * 2.0

    class Recorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.losses = []
            self.batches = 0

        def on_train_batch_end(self, batch, logs=None):
            self.batches += 1

        def on_epoch_end(self, epoch, logs=None):
            self.losses.append(float(logs["loss"]))

    def make_model():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), Doubled(), keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy")
        return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(99, 5)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    schedule = lambda epoch, rate: 0.05 * 0.5**epoch  # noqa: E731  (a lambda: what pickle cannot send)
    seen_rates = []

    reference = make_model()
    expected = reference.fit(
        x,
        y,
        batch_size=32,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.LearningRateScheduler(schedule)],
    )
    recorder = Recorder()
    stopper = keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=0)
    with torch_dp.Trainer(num_replicas=int(sys.argv[1])) as trainer:
        model = make_model()  # a model object with a __main__ layer: rebuilt in the worker from its .keras
        history = trainer.fit(
            model,
            x,
            y,
            global_batch_size=32,
            epochs=3,
            shuffle=False,
            verbose=0,
            callbacks=[
                keras.callbacks.LearningRateScheduler(schedule),
                keras.callbacks.LambdaCallback(
                    on_epoch_begin=lambda epoch, logs: seen_rates.append(float(model.optimizer.learning_rate))
                ),
                recorder,
            ],
        )
        from_factory = trainer.fit(make_model, x, y, global_batch_size=32, epochs=3, verbose=0, callbacks=[stopper])
    pairs = (model.get_weights(), reference.get_weights())
    print(
        json.dumps(
            {
                "weights_diff": max(float(np.abs(a - b).max()) for a, b in zip(*pairs, strict=True)),
                "loss_diff": float(np.abs(np.array(history.history["loss"]) - expected.history["loss"]).max()),
                "recorded": recorder.losses == history.history["loss"],
                "batches": recorder.batches,
                "seen_rates": seen_rates,
                "stopped_epoch": stopper.stopped_epoch,
                "factory_epochs": from_factory.epoch,
            }
        )
    )
