"""A tiny transformer model file (build_model, loss, optimizer, sample_batch) for the apply
tests: Embedding, self-attention, a Dense MLP and LayerNormalization, next-token logits."""
import keras
import numpy as np

VOCAB, SEQ, HIDDEN, HEADS = 24, 8, 16, 4

loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = keras.optimizers.Adam(learning_rate=1e-2)


def build_model():
    ids = keras.Input(shape=(SEQ,), dtype="int32", name="ids")
    x = keras.layers.Embedding(VOCAB, HIDDEN, name="embed")(ids)
    a = keras.layers.MultiHeadAttention(HEADS, HIDDEN // HEADS, name="attention")(
        x, x, use_causal_mask=True)
    x = keras.layers.LayerNormalization(name="ln_attention")(keras.layers.Add(name="res_1")([x, a]))
    h = keras.layers.Dense(4 * HIDDEN, activation="gelu", name="mlp_up")(x)
    h = keras.layers.Dense(HIDDEN, name="mlp_down")(h)
    x = keras.layers.LayerNormalization(name="ln_mlp")(keras.layers.Add(name="res_2")([x, h]))
    logits = keras.layers.Dense(VOCAB, name="logits")(x)
    return keras.Model(ids, logits, name="tiny_transformer")


def sample_batch(batch_size):
    rng = np.random.default_rng(batch_size)
    start = rng.integers(0, VOCAB, size=(batch_size, 1))
    step = rng.integers(1, 4, size=(batch_size, 1))
    seq = (start + step * np.arange(SEQ + 1)) % VOCAB  # arithmetic sequences mod VOCAB
    return seq[:, :-1].astype("int32"), seq[:, 1:].astype("int32")
