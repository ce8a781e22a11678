"""Where ``evaluate``/``predict`` follow Keras's own loops (issue 43) on 2 replicas, against plain
``model.evaluate``/``predict`` on one device, same seed and data."""

import keras
import numpy as np
import pytest
import torch_dp_testing as testing

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


@pytest.fixture
def trainer(two_replicas):
    return two_replicas  # the run's replicas (conftest.py)


class StopsAfter(keras.callbacks.Callback):
    """Stops the evaluation and the prediction at the end of batch ``batch``."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch = batch

    def on_test_batch_end(self, batch, logs=None):
        self.model.stop_evaluating = batch == self.batch

    def on_predict_batch_end(self, batch, logs=None):
        self.model.stop_predicting = batch == self.batch


class Counted:
    """A finite generator of global batches of 32 that counts the batches read."""

    def __init__(self, x: np.ndarray, y: np.ndarray | None = None) -> None:
        self.x, self.y, self.read = x, y, 0

    def __iter__(self):
        for start in range(0, len(self.x), 32):
            self.read += 1
            rows = slice(start, start + 32)
            yield (self.x[rows],) if self.y is None else (self.x[rows], self.y[rows])


def test_a_callback_stopping_evaluation_and_prediction_ends_them_after_that_batch(trainer):
    x, y = testing.data(198)  # 7 batches
    runs = {}
    for name in ("keras", "torch_dp"):
        model = testing.dense_batchnorm_model("sgd")
        evaluated, predicted = Counted(x, y), Counted(x)
        if name == "keras":
            logs = model.evaluate(iter(evaluated), callbacks=[StopsAfter(1)], verbose=0, return_dict=True)
            outputs = model.predict(iter(predicted), callbacks=[StopsAfter(1)], verbose=0)
        else:
            logs = trainer.evaluate(model, iter(evaluated), callbacks=[StopsAfter(1)], verbose=0, return_dict=True)
            outputs = trainer.predict(model, iter(predicted), callbacks=[StopsAfter(1)], verbose=0)
        runs[name] = logs, outputs, evaluated.read, predicted.read

    (expected_logs, expected_outputs, *expected_read), (logs, outputs, *read) = runs["keras"], runs["torch_dp"]
    assert read == expected_read
    assert outputs.shape == expected_outputs.shape == (64, 3)
    np.testing.assert_allclose(outputs, expected_outputs, rtol=1e-5, atol=1e-6)
    assert set(logs) == set(expected_logs)
    for name, value in expected_logs.items():
        np.testing.assert_allclose(logs[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
