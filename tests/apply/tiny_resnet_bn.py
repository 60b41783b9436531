"""A tiny ResNet-style model with BatchNormalization (Functional) for the apply tests."""
import keras
import numpy as np

loss = "sparse_categorical_crossentropy"
optimizer = keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)


def build_model():
    inputs = keras.Input(shape=(8, 8, 3), name="image")
    x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="stem_conv")(inputs)
    x = keras.layers.BatchNormalization(name="stem_norm")(x)
    x = keras.layers.Activation("relu", name="stem_relu")(x)
    y = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="a_conv")(x)
    y = keras.layers.BatchNormalization(name="a_norm")(y)
    y = keras.layers.Activation("relu", name="a_relu")(y)
    y = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="b_conv")(y)
    y = keras.layers.BatchNormalization(momentum=0.9, name="b_norm")(y)
    x = keras.layers.Add(name="residual")([x, y])
    x = keras.layers.Activation("relu", name="res_relu")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    x = keras.layers.Dense(16, name="dense_mid")(x)
    x = keras.layers.BatchNormalization(name="mid_norm")(x)
    outputs = keras.layers.Dense(4, activation="softmax", name="classifier")(x)
    return keras.Model(inputs, outputs, name="tiny_resnet_bn")


def sample_batch(batch_size):
    rng = np.random.default_rng(2000 + batch_size)
    x = (rng.normal(size=(batch_size, 8, 8, 3)) * 2 + 0.5).astype("float32")
    y = (x[:, :4, :4, 0].mean(axis=(1, 2)) > 0.5).astype("int64") \
        + 2 * (x[:, 4:, 4:, 1].mean(axis=(1, 2)) > 0.5).astype("int64")
    return x, y
