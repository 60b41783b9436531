"""Example model file: a Llama-style decoder (Touvron et al., 2023, "Llama 2"), stock Keras.

``build_model()`` builds ``llama(...)`` with the sizes in the environment variables
LLAMA_LAYERS, LLAMA_HIDDEN, LLAMA_HEADS (query heads), LLAMA_KV_HEADS, LLAMA_FFN (the
SwiGLU hidden size), LLAMA_VOCAB and LLAMA_SEQ. The defaults are small (2 blocks, hidden
64, 4 query heads, 2 key/value heads, SwiGLU 172, vocabulary 256, 32 tokens) so
``plan analyze examples/llama.py`` runs in seconds on a CPU. A 7B configuration:

    LLAMA_LAYERS=32 LLAMA_HIDDEN=4096 LLAMA_HEADS=32 LLAMA_KV_HEADS=8 LLAMA_FFN=11008 \\
    LLAMA_VOCAB=32000 LLAMA_SEQ=4096 plan profile examples/llama.py --precision mixed_bfloat16

(Llama-2-7B itself has 32 key/value heads -- plain multi-head attention -- and FFN
11008; with 8 key/value heads that is its grouped-query form, as in Llama-2-70B;
Llama-3-8B: LLAMA_FFN=14336 LLAMA_VOCAB=128256 LLAMA_SEQ=8192, 8 key/value heads.)

The layers, per block: RMS normalization, GroupQueryAttention with a causal mask (no
biases), a residual Add, RMS normalization, the SwiGLU MLP -- Dense gate with SiLU and
Dense up, their product (Multiply), Dense down, no biases -- and a residual Add; then a
final RMS normalization and an untied Dense head. The normalization is
``keras.layers.RMSNormalization``: Keras 3.15 deprecates
``LayerNormalization(rms_scaling=True)``, which divides by the root of the variance
(mean subtracted), not the root mean square.

Not here: rotary position embeddings (RoPE). Keras core has none (keras_hub has
``RotaryEmbedding``, applied inside its own attention layer to the projected queries and
keys); GroupQueryAttention has no hook for it, so this model has no position encoding.
RoPE costs a few element-wise FLOPs per query and key element and no parameters, so
the profile's parameters, matmul FLOPs and memory are those of the real model.

Try:  plan analyze examples/llama.py --cluster cpu:4 --global-batch 8
"""
from __future__ import annotations

import os

import keras
import numpy as np

loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = "adam"


def _size(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
          seq: int) -> keras.Model:
    """A pre-norm decoder of ``layers`` blocks (see the module docstring); next-token
    logits for ``seq`` token ids."""
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden {hidden}, {heads} query heads and {kv_heads} key/value "
                         "heads: expected hidden divisible by the query heads and those by "
                         "the key/value heads.")
    tokens = keras.Input((seq,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocab, hidden, name="tok_emb")(tokens)
    for i in range(layers):
        y = keras.layers.RMSNormalization(epsilon=1e-5, name=f"attn_norm_{i}")(x)
        y = keras.layers.GroupQueryAttention(hidden // heads, heads, kv_heads, use_bias=False,
                                             name=f"attn_{i}")(y, y, use_causal_mask=True)
        x = keras.layers.Add(name=f"attn_res_{i}")([x, y])
        y = keras.layers.RMSNormalization(epsilon=1e-5, name=f"mlp_norm_{i}")(x)
        gate = keras.layers.Dense(ffn, activation="silu", use_bias=False, name=f"gate_{i}")(y)
        up = keras.layers.Dense(ffn, use_bias=False, name=f"up_{i}")(y)
        y = keras.layers.Multiply(name=f"swiglu_{i}")([gate, up])
        y = keras.layers.Dense(hidden, use_bias=False, name=f"down_{i}")(y)
        x = keras.layers.Add(name=f"mlp_res_{i}")([x, y])
    x = keras.layers.RMSNormalization(epsilon=1e-5, name="final_norm")(x)
    logits = keras.layers.Dense(vocab, use_bias=False, name="lm_head")(x)
    return keras.Model(tokens, logits, name="llama")


def build_model() -> keras.Model:
    return llama(_size("LLAMA_LAYERS", 2), _size("LLAMA_HIDDEN", 64), _size("LLAMA_HEADS", 4),
                 _size("LLAMA_KV_HEADS", 2), _size("LLAMA_FFN", 172),
                 _size("LLAMA_VOCAB", 256), _size("LLAMA_SEQ", 32))


def sample_batch(batch_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, targets)``: random token ids and the same sequence shifted by one."""
    rng = np.random.default_rng(seed)
    seq, vocab = _size("LLAMA_SEQ", 32), _size("LLAMA_VOCAB", 256)
    ids = rng.integers(0, vocab, size=(batch_size, seq + 1), dtype=np.int32)
    return ids[:, :-1], ids[:, 1:]
