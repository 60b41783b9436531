"""A tiny MLP whose first layer adds a loss (an L2 activity regularizer, Keras' add_loss):
under a pipeline across workers its added loss is on the first stage's worker, the
model's loss on the last one's."""
import keras
import numpy as np

loss = "mse"
optimizer = keras.optimizers.SGD(learning_rate=0.1)


def build_model():
    inputs = keras.Input(shape=(6,), name="features")
    x = keras.layers.Dense(12, activation="tanh", name="hidden",
                           activity_regularizer=keras.regularizers.L2(0.05))(inputs)
    outputs = keras.layers.Dense(2, name="head")(x)
    return keras.Model(inputs, outputs, name="tiny_regularized")


def sample_batch(batch_size):
    rng = np.random.default_rng(batch_size)
    x = rng.normal(size=(batch_size, 6)).astype("float32")
    y = np.stack([x[:, :3].sum(1), np.cos(x[:, 3])], axis=1)
    return x, y.astype("float32")
