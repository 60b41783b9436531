"""A branchy model file (build_model, loss, optimizer, sample_batch) for the placement tests.

features -> stem -> two wide independent Dense branches -> Concatenate -> head: the
branches hold almost all the work and weights, and no path orders one before the
other, so a general placement can run them at the same time on two devices.
"""
import keras
import numpy as np

INPUT_FEATURES = 32
BRANCH_UNITS = 1024
NUM_BRANCHES = 2

loss = "mse"
optimizer = keras.optimizers.Adam(learning_rate=1e-3)


def build_model():
    inputs = keras.Input(shape=(INPUT_FEATURES,), name="features")
    stem = keras.layers.Dense(32, activation="relu", name="stem")(inputs)
    branches = [keras.layers.Dense(BRANCH_UNITS, activation="tanh", name=f"branch_{i}")(stem)
                for i in range(NUM_BRANCHES)]
    merged = keras.layers.Concatenate(name="merge")(branches)
    outputs = keras.layers.Dense(3, name="head")(merged)
    return keras.Model(inputs, outputs, name="branchy")


def sample_batch(batch_size):
    rng = np.random.default_rng(batch_size)
    x = rng.normal(size=(batch_size, INPUT_FEATURES)).astype("float32")
    y = np.stack([x[:, :4].sum(1), np.sin(x[:, 4]), x[:, 5] * x[:, 6]], axis=1)
    return x, y.astype("float32")
