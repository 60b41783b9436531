"""Example model file: a decoder-only GPT whose feed-forward layers are mixtures of experts.

``build_model()`` builds ``moe_gpt(...)`` with the sizes in the environment variables
MOE_LAYERS, MOE_HIDDEN, MOE_HEADS, MOE_EXPERTS, MOE_TOP_K, MOE_EXPERT_HIDDEN (each
expert's MLP width), MOE_EVERY (an MoE feed-forward every MOE_EVERY-th block, a dense
one of width 4 x hidden in the others), MOE_CAPACITY (capacity factor; "none", the
default, drops no token), MOE_AUX (load-balancing loss weight, default 0.01), MOE_VOCAB
and MOE_SEQ. The defaults are small (2 blocks, hidden 32, 4 heads, 8 experts, top-2,
expert width 64, vocabulary 128, 16 tokens) so ``plan analyze examples/moe_gpt.py`` runs in
seconds on a CPU.

The experts are ``tfplan.layers.MixtureOfExperts`` (a router, top-k gating, optional
capacity, the load-balancing loss); everything else is stock Keras (Embedding,
LayerNormalization, MultiHeadAttention with a causal mask, Dense, Add).

A Switch-C-sized decoder (Fedus et al., 2021, Table 9: d_model 2048, FFN 6144, 2048
experts, top-1, 32 heads, every feed-forward an MoE; Switch-C has 15 encoder and 15
decoder blocks, here 30 decoder blocks), 1.55e12 parameters:

    MOE_LAYERS=30 MOE_HIDDEN=2048 MOE_HEADS=32 MOE_EXPERTS=2048 MOE_TOP_K=1 \\
    MOE_EXPERT_HIDDEN=6144 MOE_CAPACITY=1.0 MOE_VOCAB=32128 MOE_SEQ=512 \\
    plan analyze examples/moe_gpt.py --cluster 64x8xA100-80GB --global-batch 2048 \\
        --precision mixed_bfloat16

Try:  plan analyze examples/moe_gpt.py --cluster cpu:4 --global-batch 8
"""
from __future__ import annotations

import os

import keras
import numpy as np

from tfplan.layers import MixtureOfExperts

loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = "adam"


def _size(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _capacity() -> float | None:
    raw = os.environ.get("MOE_CAPACITY", "none").strip().lower()
    return None if raw in ("", "none") else float(raw)


def moe_gpt(layers: int, hidden: int, heads: int, experts: int, top_k: int,
            expert_hidden: int, vocab: int, seq: int, *, every: int = 1,
            capacity_factor: float | None = None, aux_loss_weight: float = 0.01
            ) -> keras.Model:
    """A pre-norm GPT of ``layers`` blocks (module docstring): next-token logits for
    ``seq`` token ids; block i's feed-forward is a MixtureOfExperts when i % every ==
    every - 1, a dense 4 x hidden GELU MLP otherwise."""
    if hidden % heads:
        raise ValueError(f"hidden {hidden} is not divisible by {heads} heads; choose "
                         "MOE_HIDDEN a multiple of MOE_HEADS.")
    tokens = keras.Input((seq,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocab, hidden, name="tok_emb")(tokens)
    for i in range(layers):
        y = keras.layers.LayerNormalization(epsilon=1e-5, name=f"ln_attn_{i}")(x)
        y = keras.layers.MultiHeadAttention(heads, hidden // heads, name=f"attn_{i}")(
            y, y, use_causal_mask=True)
        x = keras.layers.Add(name=f"attn_res_{i}")([x, y])
        y = keras.layers.LayerNormalization(epsilon=1e-5, name=f"ln_mlp_{i}")(x)
        if i % every == every - 1:
            y = MixtureOfExperts(experts, top_k, expert_hidden, capacity_factor=capacity_factor,
                                 aux_loss_weight=aux_loss_weight, name=f"moe_{i}")(y)
        else:
            y = keras.layers.Dense(4 * hidden, activation="gelu", name=f"mlp_in_{i}")(y)
            y = keras.layers.Dense(hidden, name=f"mlp_out_{i}")(y)
        x = keras.layers.Add(name=f"mlp_res_{i}")([x, y])
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_final")(x)
    logits = keras.layers.Dense(vocab, name="lm_head")(x)
    return keras.Model(tokens, logits, name="moe_gpt")


def build_model() -> keras.Model:
    return moe_gpt(_size("MOE_LAYERS", 2), _size("MOE_HIDDEN", 32), _size("MOE_HEADS", 4),
                   _size("MOE_EXPERTS", 8), _size("MOE_TOP_K", 2),
                   _size("MOE_EXPERT_HIDDEN", 64), _size("MOE_VOCAB", 128),
                   _size("MOE_SEQ", 16), every=_size("MOE_EVERY", 1),
                   capacity_factor=_capacity(),
                   aux_loss_weight=float(os.environ.get("MOE_AUX", "0.01")))


def sample_batch(batch_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, targets)``: random token ids and the same sequence shifted by one."""
    rng = np.random.default_rng(seed)
    seq, vocab = _size("MOE_SEQ", 16), _size("MOE_VOCAB", 128)
    ids = rng.integers(0, vocab, size=(batch_size, seq + 1), dtype=np.int32)
    return ids[:, :-1], ids[:, 1:]
