"""A tiny Llama-style model file (build_model, loss, optimizer, sample_batch) for the apply
tests: Embedding, one decoder block with RMS-scaled LayerNormalization, causal grouped-query
attention (4 query heads sharing 2 key/value heads) and a SwiGLU MLP (silu(gate) * up ->
down), a final norm and next-token logits. No position embedding (the sequences are
arithmetic, causal attention alone sees the order)."""
import keras
import numpy as np

VOCAB, SEQ, HIDDEN, HEAD_DIM, Q_HEADS, KV_HEADS, FFN = 24, 8, 16, 4, 4, 2, 32

loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = keras.optimizers.Adam(learning_rate=1e-2)


def rms_norm(name):
    return keras.layers.LayerNormalization(rms_scaling=True, name=name)


def build_model():
    ids = keras.Input(shape=(SEQ,), dtype="int32", name="ids")
    x = keras.layers.Embedding(VOCAB, HIDDEN, name="embed")(ids)
    h = rms_norm("norm_attention")(x)
    a = keras.layers.GroupQueryAttention(HEAD_DIM, Q_HEADS, KV_HEADS, use_bias=False,
                                         name="attention")(h, h, use_causal_mask=True)
    x = keras.layers.Add(name="res_1")([x, a])
    h = rms_norm("norm_mlp")(x)
    gate = keras.layers.Dense(FFN, activation="silu", use_bias=False, name="mlp_gate")(h)
    up = keras.layers.Dense(FFN, use_bias=False, name="mlp_up")(h)
    h = keras.layers.Multiply(name="swiglu")([gate, up])
    h = keras.layers.Dense(HIDDEN, use_bias=False, name="mlp_down")(h)
    x = keras.layers.Add(name="res_2")([x, h])
    x = rms_norm("norm_out")(x)
    logits = keras.layers.Dense(VOCAB, use_bias=False, name="logits")(x)
    return keras.Model(ids, logits, name="tiny_llama")


def sample_batch(batch_size):
    rng = np.random.default_rng(batch_size)
    start = rng.integers(0, VOCAB, size=(batch_size, 1))
    step = rng.integers(1, 4, size=(batch_size, 1))
    seq = (start + step * np.arange(SEQ + 1)) % VOCAB  # arithmetic sequences mod VOCAB
    return seq[:, :-1].astype("int32"), seq[:, 1:].astype("int32")
