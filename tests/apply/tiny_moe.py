"""A tiny mixture-of-experts model file (build_model, loss, optimizer, sample_batch) for the
apply tests: tokens of width 16 through a routed ``tfplan.layers.MixtureOfExperts`` (8
experts, top 2, no capacity limit, no aux loss: training is one device's under any plan)."""
import keras
import numpy as np

from tfplan.layers import MixtureOfExperts

loss = "mse"
optimizer = keras.optimizers.Adam(learning_rate=1e-2)
SEQ, FEATURES, WIDTH = 4, 6, 16


def build_model(num_experts=8, capacity_factor=None, aux_loss_weight=0.0):
    inputs = keras.Input(shape=(SEQ, FEATURES), name="tokens")
    x = keras.layers.Dense(WIDTH, activation="tanh", name="embed")(inputs)
    moe = MixtureOfExperts(num_experts=num_experts, top_k=2, expert_hidden=16,
                           capacity_factor=capacity_factor, aux_loss_weight=aux_loss_weight,
                           name="moe")(x)
    x = keras.layers.Add(name="residual")([x, moe])
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = keras.layers.Dense(3, name="head")(x)
    return keras.Model(inputs, outputs, name="tiny_moe")


def sample_batch(batch_size):
    rng = np.random.default_rng(batch_size)
    x = rng.normal(size=(batch_size, SEQ, FEATURES)).astype("float32")
    y = np.stack([x[:, :, :2].sum((1, 2)), np.sin(x[:, 0, 3]), x[:, 1, 4] * x[:, 2, 5]], 1)
    return x, y.astype("float32")
