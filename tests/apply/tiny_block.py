"""A tiny model file (build_model, loss, optimizer, sample_batch) with *blocks*: a custom
composite layer ``Residual`` (``x + down(up(x))``, two Dense sub-layers made in its
``__init__`` and built in its ``build``) used twice between a Dense embedding and a Dense
head. The profile lists each block and its sub-layers (``block_0``, ``block_0/up``,
``block_0/down``, ...); the apply tests split the Dense pair column/row inside the blocks."""
import keras
import numpy as np

loss = "mse"
optimizer = keras.optimizers.Adam(learning_rate=1e-2)


class Residual(keras.layers.Layer):
    """``x + down(up(x))``: a block whose own code (the residual add) surrounds its two
    Dense sub-layers."""

    def __init__(self, hidden, width, activation="relu", **kwargs):
        super().__init__(**kwargs)
        self.hidden, self.width, self.activation = hidden, width, activation
        self.up = keras.layers.Dense(hidden, activation=activation, name="up")
        self.down = keras.layers.Dense(width, name="down")

    def build(self, input_shape):
        self.up.build(input_shape)
        self.down.build((*input_shape[:-1], self.hidden))

    def call(self, x):
        return x + self.down(self.up(x))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "hidden": self.hidden, "width": self.width,
                "activation": self.activation}


def build_model():
    inputs = keras.Input(shape=(12,), name="features")
    x = keras.layers.Dense(16, activation="tanh", name="embed")(inputs)
    x = Residual(32, 16, name="block_0")(x)
    x = Residual(24, 16, activation="tanh", name="block_1")(x)
    outputs = keras.layers.Dense(3, name="head")(x)
    return keras.Model(inputs, outputs, name="tiny_block")


def sample_batch(batch_size):
    rng = np.random.default_rng(batch_size)
    x = rng.normal(size=(batch_size, 12)).astype("float32")
    y = np.stack([x[:, :4].sum(1), np.sin(x[:, 4]), x[:, 5] * x[:, 6]], axis=1)
    return x, y.astype("float32")
