"""A tiny masked sequence model in the style of keras.io's English-to-Spanish translator:
token embeddings with ``mask_zero=True`` over padded sequences, so the loss Keras computes
skips the padding (its mean is over the unmasked tokens only)."""
import keras
import numpy as np
from keras import layers

VOCAB, SEQ, DIM, HEADS = 16, 6, 8, 2

loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = keras.optimizers.Adam(learning_rate=1e-2)


def build_model():
    ids = keras.Input(shape=(SEQ,), dtype="int32", name="tokens")
    x = layers.Embedding(VOCAB, DIM, mask_zero=True, name="embed")(ids)
    a = layers.MultiHeadAttention(HEADS, DIM // HEADS, name="attention")(x, x)
    x = layers.LayerNormalization(name="ln")(layers.Add(name="res")([x, a]))
    h = layers.Dense(2 * DIM, activation="relu", name="mlp_up")(x)
    h = layers.Dense(DIM, name="mlp_down")(h)
    logits = layers.Dense(VOCAB, name="logits")(h)
    return keras.Model(ids, logits, name="tiny_seq2seq")


def sample_batch(batch_size):
    """Sequences of different lengths, padded with 0 (the mask); every replica's share of
    a batch holds a different number of real tokens."""
    rng = np.random.default_rng(batch_size)
    lengths = rng.integers(1, SEQ + 1, size=batch_size)
    x = rng.integers(1, VOCAB, size=(batch_size, SEQ))
    x[np.arange(SEQ)[None, :] >= lengths[:, None]] = 0
    y = np.where(x > 0, (x + 1) % VOCAB, 0)
    return x.astype("int32"), y.astype("int32")
