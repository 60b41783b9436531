"""A tiny model with one ``tfplan.layers.MixtureOfExperts`` (4 experts, top-2, capacity
factor 1.25) between two Dense layers, for ``plan profile`` in ``tests/profiler/test_moe.py``."""
import keras

from tfplan.layers import MixtureOfExperts

SEQ, WIDTH = 6, 8
optimizer = "sgd"


def build_model():
    x = keras.Input((SEQ, WIDTH), name="x")
    y = keras.layers.Dense(WIDTH, name="before")(x)
    y = MixtureOfExperts(4, 2, 16, capacity_factor=1.25, name="moe")(y)
    return keras.Model(x, keras.layers.Dense(WIDTH, name="after")(y), name="tiny_moe")
