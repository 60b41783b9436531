"""Example model file for ``plan analyze``: a small CNN with one residual block.

A model file is a plain Python file; the planner imports it and reads:

* ``build_model()`` -- returns a *new* Functional keras.Model on 16x16 RGB
  images (explicit ``keras.Input``, so it is built without data)::

      image (16x16x3)
        conv_1   Conv2D 16, 3x3, same, relu   -> 16x16x16
        bn_1     BatchNormalization           -> 16x16x16  (gamma/beta trainable,
                                                            moving stats not)
        pool_1   MaxPooling2D 2x2             -> 8x8x16 ----------.
        conv_2   Conv2D 16, 3x3, same, relu   -> 8x8x16           |
        conv_3   Conv2D 16, 3x3, same         -> 8x8x16           |
        add_1    Add [pool_1, conv_3]         -> 8x8x16 <---------'
        relu_1   Activation relu              -> 8x8x16
        gap      GlobalAveragePooling2D       -> 16
        dense_1  Dense 10 (logits)            -> 10

  Every layer has an explicit name so plans and reports are readable.
* ``loss`` -- sparse categorical cross-entropy on logits.
* ``optimizer`` -- an optimizer *name* ("adam"), not an object: each user
  (replica, test, profiler) makes its own fresh optimizer from it.
* ``sample_batch(batch_size)`` -- a deterministic ``(x, y)`` numpy batch
  (seeded RNG): x float32 (batch_size, 16, 16, 3) in [0, 1), y int32 in [0, 10).

Try:  plan analyze examples/cnn.py --cluster cpu:4 --global-batch 64
"""
from __future__ import annotations

import keras
import numpy as np

IMAGE_SIZE = 16
CHANNELS = 3
FILTERS = 16
NUM_CLASSES = 10

loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = "adam"


def build_model() -> keras.Model:
    conv = dict(kernel_size=3, padding="same")
    inputs = keras.Input(shape=(IMAGE_SIZE, IMAGE_SIZE, CHANNELS), name="image")
    x = keras.layers.Conv2D(FILTERS, activation="relu", name="conv_1", **conv)(inputs)
    x = keras.layers.BatchNormalization(name="bn_1")(x)
    shortcut = keras.layers.MaxPooling2D(2, name="pool_1")(x)
    x = keras.layers.Conv2D(FILTERS, activation="relu", name="conv_2", **conv)(shortcut)
    x = keras.layers.Conv2D(FILTERS, name="conv_3", **conv)(x)
    x = keras.layers.Add(name="add_1")([shortcut, x])
    x = keras.layers.Activation("relu", name="relu_1")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    outputs = keras.layers.Dense(NUM_CLASSES, name="dense_1")(x)
    return keras.Model(inputs, outputs, name="cnn")


def sample_batch(batch_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.random((batch_size, IMAGE_SIZE, IMAGE_SIZE, CHANNELS), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, size=(batch_size,), dtype=np.int32)
    return x, y
