"""A tiny CNN with a residual Add (Functional) model file for the apply tests."""
import keras
import numpy as np

loss = "sparse_categorical_crossentropy"
optimizer = keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)


def build_model():
    inputs = keras.Input(shape=(8, 8, 3), name="image")
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="stem")(inputs)
    y = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="res_a")(x)
    y = keras.layers.Conv2D(8, 3, padding="same", name="res_b")(y)
    x = keras.layers.Add(name="residual")([x, y])
    x = keras.layers.Activation("relu", name="res_relu")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = keras.layers.Dense(4, activation="softmax", name="classifier")(x)
    return keras.Model(inputs, outputs, name="tiny_cnn")


def sample_batch(batch_size):
    rng = np.random.default_rng(1000 + batch_size)
    x = rng.normal(size=(batch_size, 8, 8, 3)).astype("float32")
    y = (x[:, :4, :4, 0].mean(axis=(1, 2)) > 0).astype("int64") \
        + 2 * (x[:, 4:, 4:, 1].mean(axis=(1, 2)) > 0).astype("int64")
    return x, y
