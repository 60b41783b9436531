"""Attention cores (profiler.attention_core) of Keras' MultiHeadAttention and
GroupQueryAttention, against the closed forms in b (batch), n (query heads), t (query
positions), s (key positions), d (head size).

The ops Keras 3.15 emits on TensorFlow: without dropout, ``ops.dot_product_attention``
-- scores einsum (2 b n t s d), their scale (1 per score), with a causal mask a
LogicalAnd of the masks (1 per score) and a select (0), Softmax (5 per score,
op_flops), context einsum (2 b n t s d). With dropout, MultiHeadAttention's own path:
the query is scaled before the scores (outside the core), the causal mask is built from
two Cumsum and a GreaterEqual on (1, t, s) (3 t s), and the dropout costs 4 per score
(its 1/keep scale, the uniform numbers' scale and shift, the compare) plus 5 on its
2-element seed (Mul 2, FloorMod 2, the range's Sub 1).
"""
from __future__ import annotations

import keras
import pytest
import tensorflow as tf

from tfplan.profiler.comm import layer_comm
from tfplan.profiler.model_profile import LayerProfile
from tfplan.profiler.static import profile_model

B, T, H = 2, 8, 16


def core_flops(b: int, n: int, t: int, s: int, dk: int, dv: int, *, causal: bool,
               dropout: bool) -> int:
    contractions = 2 * b * n * t * s * dk + 2 * b * n * t * s * dv
    if dropout:
        return contractions + (5 + 4) * b * n * t * s + 5 + (3 * t * s if causal else 0)
    return contractions + (1 + 5 + (1 if causal else 0)) * b * n * t * s


def profiled(layer_call, *, precision: str = "float32", batch: int = B, inputs=((T, H),)):
    with tf.Graph().as_default():
        before = keras.config.dtype_policy()
        keras.config.set_dtype_policy(precision)
        try:
            xs = [keras.Input(shape) for shape in inputs]
            model = keras.Model(xs, layer_call(*xs))
            return profile_model(model, batch, optimizer="adam"), model
        finally:
            keras.config.set_dtype_policy(before)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_multi_head_attention_core_is_the_closed_form(causal, dropout):
    n, d = 4, 4
    p, _ = profiled(lambda x: keras.layers.MultiHeadAttention(n, d, dropout=dropout,
                                                              name="att")(
        x, x, use_causal_mask=causal))
    att = p.layer("att")
    scores = B * n * T * T
    assert att.attention_core_flops_fwd == core_flops(B, n, T, T, d, d, causal=causal,
                                                      dropout=bool(dropout))
    # float32: the softmax output (4 bytes a score); with dropout also its mask (1) and
    # output (4) -- Korthikanti et al.'s three tensors
    assert att.attention_core_saved_bytes == (9 if dropout else 4) * scores
    assert att.attention_kv_bytes == 2 * B * T * n * d * 4  # projected keys and values
    assert att.attention_kv_heads == n
    # all inside the layer's own numbers
    assert att.attention_core_flops_fwd < att.flops_fwd
    assert att.attention_core_saved_bytes < att.activation_saved_bytes
    # the rest of the saved bytes: Q, K, V (or their transposes) and the context
    assert att.activation_saved_bytes - att.attention_core_saved_bytes == 4 * B * T * n * d * 4


def test_mixed_float16_with_dropout_saves_korthikanti_5_a_s2_b():
    n, d = 4, 4
    p, _ = profiled(lambda x: keras.layers.MultiHeadAttention(n, d, dropout=0.1, name="att")(
        x, x, use_causal_mask=True), precision="mixed_float16")
    att = p.layer("att")
    assert att.attention_core_saved_bytes == 5 * n * T * T * B  # 2 + 1 + 2 bytes a score
    assert att.attention_kv_bytes == 2 * B * T * n * d * 2
    assert att.attention_core_flops_fwd == core_flops(B, n, T, T, d, d, causal=True,
                                                      dropout=True)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_cross_attention_reads_the_keys_not_the_queries(dropout):
    """Query length 8, key/value length 6, key_dim 4, value_dim 2: the key/value bytes are
    the keys' and values' (a query taken for the keys would give other numbers)."""
    n, dk, dv, s = 3, 4, 2, 6
    p, _ = profiled(lambda q, k, v: keras.layers.MultiHeadAttention(
        n, dk, value_dim=dv, dropout=dropout, name="att")(q, v, key=k),
        inputs=((T, H), (s, 12), (s, 10)))
    att = p.layer("att")
    assert att.attention_kv_bytes == B * s * n * (dk + dv) * 4
    assert att.attention_core_flops_fwd == core_flops(B, n, T, s, dk, dv, causal=False,
                                                      dropout=bool(dropout))
    assert att.attention_core_saved_bytes == (9 if dropout else 4) * B * n * T * s


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_group_query_attention_profiles_like_multi_head_attention(dropout):
    nq, nkv, d = 4, 2, 4
    p, model = profiled(lambda x: keras.layers.GroupQueryAttention(
        d, nq, nkv, dropout=dropout, name="att")(x, x, use_causal_mask=True))
    att = p.layer("att")
    assert att.type == "GroupedQueryAttention"
    assert att.params == model.count_params() == \
        (H * nq * d + nq * d) + 2 * (H * nkv * d + nkv * d) + (nq * d * H + H)
    core = core_flops(B, nq, T, T, d, d, causal=True, dropout=bool(dropout))
    projections = (2 * B * T * H * nq * d + B * T * nq * d            # query + bias
                   + 2 * (2 * B * T * H * nkv * d + B * T * nkv * d)  # key, value + biases
                   + 2 * B * T * nq * d * H + B * T * H)              # output + bias
    # the dropout path scales the query (outside the core) and advances the dropout's
    # 2-element seed state (an Add, 2)
    dropout_outside = B * T * nq * d + 2 if dropout else 0
    # + 2: the two repeats of the key/value heads multiply two int32 scalars (their size)
    assert att.flops_fwd == projections + core + dropout_outside + 2
    assert att.attention_core_flops_fwd == core
    assert att.attention_core_saved_bytes == (9 if dropout else 4) * B * nq * T * T
    # the keys and values before the repeat to the query heads: what context parallelism
    # exchanges
    assert att.attention_kv_bytes == 2 * B * T * nkv * d * 4
    assert att.attention_kv_heads == nkv
    assert att.not_counted == ()


def test_layers_without_an_attention_core_have_none_and_a_dropout_keeps_its_mask():
    p, _ = profiled(lambda x: keras.layers.Dropout(0.5, name="drop")(
        keras.layers.Dense(8, activation="softmax", name="dense")(x)))
    for name in ("dense", "drop"):
        layer = p.layer(name)
        assert (layer.attention_core_flops_fwd, layer.attention_core_saved_bytes,
                layer.attention_kv_bytes, layer.attention_kv_heads) == (0, 0, 0, 0)
    # the dropout's boolean mask is read by the gradient of its select: 1 byte an element
    assert p.layer("drop").activation_saved_bytes == B * T * 8


def test_a_shared_attention_layer_sums_its_calls():
    n, d = 2, 8

    def twice(x):
        att = keras.layers.MultiHeadAttention(n, d, name="att")
        return att(att(x, x), x)

    p, _ = profiled(twice)
    att = p.layer("att")
    assert att.calls == 2
    assert att.attention_core_flops_fwd == 2 * core_flops(B, n, T, T, d, d, causal=False,
                                                          dropout=False)
    assert att.attention_kv_bytes == 2 * (2 * B * T * n * d * 4)


def test_rms_scaled_layer_normalization_profiles_every_op():
    """keras.layers.LayerNormalization(rms_scaling=True) (deprecated in Keras 3.15: it
    divides by the variance's root, mean subtracted) and keras.layers.RMSNormalization."""
    with pytest.warns(UserWarning, match="rms_scaling"):
        p, _ = profiled(lambda x: keras.layers.LayerNormalization(rms_scaling=True,
                                                                  name="ln")(x))
    ln = p.layer("ln")
    rows, n = B * T, B * T * H
    # Mean, Sub, Square, Mean, the scale's Mul and the input's Mul; eps Add 1 and Rsqrt 2
    # per row
    assert (ln.flops_fwd, ln.not_counted, ln.params) == (6 * n + 3 * rows, (), H)
    p, _ = profiled(lambda x: keras.layers.RMSNormalization(name="rms")(x))
    rms = p.layer("rms")
    # Square, Mean, two Mul per element; Add and Rsqrt per row
    assert (rms.flops_fwd, rms.not_counted, rms.params) == (4 * n + 3 * rows, (), H)


def _attention(kind: str, kv_heads: int) -> LayerProfile:
    return LayerProfile(name="att", type=kind, params=1, trainable_params=1, param_bytes=4,
                        grad_bytes=4, optimizer_bytes=8, activation_bytes=64, flops_fwd=0,
                        flops_bwd=0, attention_kv_heads=kv_heads)


def test_a_heads_split_needs_the_degree_to_divide_the_key_value_heads():
    (gqa,) = layer_comm(_attention("GroupedQueryAttention", 8), input_bytes=64).tp_splits
    assert (gqa.split, gqa.fwd_allreduce_bytes, gqa.bwd_allreduce_bytes,
            gqa.degree_divides) == ("heads", 64, 64, 8)
    assert [t for t in range(1, 17) if gqa.allows(t)] == [1, 2, 4, 8]
    assert gqa.to_dict()["degree_divides"] == 8
    # MultiHeadAttention: its heads cut equally over the ranks too (apply.spmd)
    (mha,) = layer_comm(_attention("MultiHeadAttention", 6), input_bytes=64).tp_splits
    assert mha.degree_divides == 6 and [t for t in range(1, 17) if mha.allows(t)] == \
        [1, 2, 3, 6]


def test_attention_fields_round_trip_and_default_to_zero():
    layer = _attention("GroupedQueryAttention", 8)
    doc = layer.to_dict()
    assert LayerProfile.from_dict(doc) == layer
    for key in ("attention_core_flops_fwd", "attention_core_saved_bytes",
                "attention_kv_bytes", "attention_kv_heads"):
        doc.pop(key)
    assert LayerProfile.from_dict(doc).attention_kv_heads == 0
