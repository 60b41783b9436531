"""Example model file for ``plan analyze``: a small multi-layer perceptron.

A model file is a plain Python file; the planner imports it and reads:

* ``build_model()`` -- returns a *new* keras.Model each call. Here a Functional
  MLP with an explicit ``keras.Input`` (so it is built without data):
  32 features -> dense_1 (64, relu) -> dense_2 (64, relu) -> dense_3 (10 logits).
  Every layer has an explicit name so plans and reports are readable.
* ``loss`` -- what ``model.compile(loss=...)`` gets: sparse categorical
  cross-entropy on logits.
* ``optimizer`` -- an optimizer *name* ("adam"), not an optimizer object: a
  name is turned into a fresh optimizer wherever it is used (every replica and
  every test gets its own state), and the profiler reads its slot count
  (2 per parameter for Adam) without building anything.
* ``sample_batch(batch_size)`` -- a deterministic ``(x, y)`` numpy batch
  (seeded RNG): x float32 of shape (batch_size, 32), y int32 labels in [0, 10).

Try:  plan analyze examples/mlp.py --cluster cpu:2 --global-batch 64
"""
from __future__ import annotations

import keras
import numpy as np

INPUT_FEATURES = 32
HIDDEN_UNITS = 64
NUM_CLASSES = 10

loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = "adam"


def build_model() -> keras.Model:
    inputs = keras.Input(shape=(INPUT_FEATURES,), name="features")
    x = keras.layers.Dense(HIDDEN_UNITS, activation="relu", name="dense_1")(inputs)
    x = keras.layers.Dense(HIDDEN_UNITS, activation="relu", name="dense_2")(x)
    outputs = keras.layers.Dense(NUM_CLASSES, name="dense_3")(x)
    return keras.Model(inputs, outputs, name="mlp")


def sample_batch(batch_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch_size, INPUT_FEATURES), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, size=(batch_size,), dtype=np.int32)
    return x, y
