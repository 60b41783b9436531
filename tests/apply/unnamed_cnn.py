"""A small CNN whose layers have no names (Keras generates them: ``conv2d_3``,
``global_average_pooling2d_1``... depending on what the process built before), for
the structural plan-matching tests. ``build_model(size)``: input size x size x 3."""
import keras
import numpy as np

loss = "mse"
optimizer = keras.optimizers.Adam(learning_rate=1e-2)


def build_model(size=8):
    inputs = keras.Input(shape=(size, size, 3))
    x = keras.layers.Conv2D(6, 3, activation="relu")(inputs)
    x = keras.layers.Conv2D(8, 3, activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(16, activation="tanh")(x)
    outputs = keras.layers.Dense(2)(x)
    return keras.Model(inputs, outputs)


def sample_batch(batch_size, size=8):
    rng = np.random.default_rng(batch_size)
    x = rng.normal(size=(batch_size, size, size, 3)).astype("float32")
    y = np.stack([x.mean(axis=(1, 2, 3)), x[:, 0, 0, 0]], axis=1)
    return x, y.astype("float32")
