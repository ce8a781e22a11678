"""Run as a script: a long 2-replica fit in a daemon thread, and the interpreter ends once its
first step is done (as a script or notebook kernel that exits with a training thread running)."""

import os
import threading

os.environ["KERAS_BACKEND"] = "torch"

import keras
import torch_dp_testing as testing

import torch_dp

if __name__ == "__main__":
    x, y = testing.data()
    stepped = threading.Event()
    callback = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: stepped.set())
    trainer = torch_dp.Trainer(num_replicas=2)
    model = testing.dense_batchnorm_model()
    arguments = {"global_batch_size": 32, "epochs": 10_000, "verbose": 0, "callbacks": [callback]}
    threading.Thread(target=trainer.fit, args=(model, x, y), kwargs=arguments, daemon=True).start()
    assert stepped.wait(120), "no step within 120 s"
    print("leaving with fit running", flush=True)
