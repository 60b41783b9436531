"""A tiny masked sequence model in the style of keras.io's English-to-Spanish translator:
token embeddings with ``mask_zero=True`` over padded sequences and an encoder block that
passes the mask on, so the loss Keras computes skips the padding (its mean is over the
unmasked tokens only)."""
import keras
import numpy as np
from keras import layers, ops

VOCAB, SEQ, DIM, HEADS = 16, 6, 8, 2

loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = keras.optimizers.Adam(learning_rate=1e-2)


class TransformerEncoder(layers.Layer):
    """keras.io's encoder block as its tutorial writes it: its own arguments, no
    ``get_config``, ``supports_masking`` so the padding mask flows on to the loss."""

    def __init__(self, embed_dim, dense_dim, num_heads):
        super().__init__()
        self.attention = layers.MultiHeadAttention(num_heads, embed_dim // num_heads,
                                                   name="attention")
        self.mlp_up = layers.Dense(dense_dim, activation="relu", name="mlp_up")
        self.mlp_down = layers.Dense(embed_dim, name="mlp_down")
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        padding_mask = None if mask is None else ops.cast(mask[:, None, :], "int32")
        a = self.attention(query=inputs, value=inputs, key=inputs, attention_mask=padding_mask)
        x = self.layernorm_1(inputs + a)
        return self.layernorm_2(x + self.mlp_down(self.mlp_up(x)))


def build_model():
    ids = keras.Input(shape=(SEQ,), dtype="int32", name="tokens")
    x = layers.Embedding(VOCAB, DIM, mask_zero=True, name="embed")(ids)
    x = TransformerEncoder(DIM, 2 * DIM, HEADS)(x)
    logits = layers.Dense(VOCAB, name="logits")(x)
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
