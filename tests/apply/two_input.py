"""A two-input, two-output Functional model file for the apply tests: ``x`` is a dict
({"left": (n, 6), "right": (n, 4)}), ``y`` a list of two targets ([(n, 2), (n, 1)])."""
import keras
import numpy as np

loss = ["mse", "mse"]
optimizer = keras.optimizers.Adam(learning_rate=1e-2)


def build_model():
    left = keras.Input(shape=(6,), name="left")
    right = keras.Input(shape=(4,), name="right")
    a = keras.layers.Dense(16, activation="relu", name="left_dense")(left)
    b = keras.layers.Dense(16, activation="tanh", name="right_dense")(right)
    x = keras.layers.Concatenate(name="join")([a, b])
    x = keras.layers.Dense(16, activation="relu", name="trunk")(x)
    first = keras.layers.Dense(2, name="first")(x)
    second = keras.layers.Dense(1, name="second")(x)
    return keras.Model({"left": left, "right": right}, [first, second], name="two_input")


def sample_batch(batch_size):
    rng = np.random.default_rng(batch_size)
    left = rng.normal(size=(batch_size, 6)).astype("float32")
    right = rng.normal(size=(batch_size, 4)).astype("float32")
    first = np.stack([left[:, :3].sum(1), right[:, 0] * left[:, 3]], axis=1)
    second = np.sin(right[:, 1:2]) + left[:, 4:5]
    return {"left": left, "right": right}, [first.astype("float32"), second.astype("float32")]
