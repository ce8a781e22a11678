"""Train a convnet on scikit-learn's handwritten digits with 2 data-parallel torch replicas."""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import torch_dp


def load_data():
    digits = load_digits()  # 1,797 real 8x8 images, shipped inside scikit-learn
    x = (digits.images / 16.0).astype("float32")[..., None]
    return train_test_split(x, digits.target, test_size=0.2, random_state=0)


def build_model() -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


if __name__ == "__main__":  # spawned replicas import this file too
    x_train, x_test, y_train, y_test = load_data()
    trainer = torch_dp.Trainer(num_replicas=2)
    model = build_model()
    trainer.fit(model, x_train, y_train, global_batch_size=64, epochs=15, validation_data=(x_test, y_test))
    print(trainer.evaluate(model, x_test, y_test, global_batch_size=64, return_dict=True))
