"""A tiny MLP model file (build_model, loss, optimizer, sample_batch) for the apply tests."""
import keras
import numpy as np

loss = "mse"
optimizer = keras.optimizers.Adam(learning_rate=1e-2)


def build_model():
    inputs = keras.Input(shape=(12,), name="features")
    x = keras.layers.Dense(32, activation="relu", name="dense_in")(inputs)
    x = keras.layers.Dense(32, activation="tanh", name="hidden")(x)
    x = keras.layers.Dense(16, activation="relu", name="narrow")(x)
    outputs = keras.layers.Dense(3, name="head")(x)
    return keras.Model(inputs, outputs, name="tiny_mlp")


def sample_batch(batch_size):
    rng = np.random.default_rng(batch_size)
    x = rng.normal(size=(batch_size, 12)).astype("float32")
    y = np.stack([x[:, :4].sum(1), np.sin(x[:, 4]), x[:, 5] * x[:, 6]], axis=1)
    return x, y.astype("float32")
