"""keras_hub's GPT-2, Llama 3 and Gemma backbones, and user-defined blocks, through the profiler.

Small random-weight configurations, built in ``tf.Graph().as_default()`` (no weights
allocated) inside a functional model with fixed-shape inputs. Checked: parameters
(total, ``model.count_params()``, the closed form, and every entry against its layer's own
``count_params()``); forward FLOPs entry by entry and in total against closed forms read
off the keras_hub / Keras / TensorFlow source for a training step; the block structure
(``block/sub`` entries, ``block``, ``kind``, ``opaque``, the order a block calls its
sub-layers in).

Symbols: b samples of s tokens, hidden h, n query heads of d, k key/value heads, MLP width
f (Gemma: each of its two gates ``intermediate_dim / 2``), vocabulary V, P GPT-2
positions, L blocks; float32, ``profiler.op_flops``' rules (a multiply-add 2, each
element-wise op 1 per output element, Rsqrt and SquaredDifference 2, Softmax 5 per
element, reductions in - out, Mean in, Cast/Select/Reshape/Gather/Slice 0).

Shared terms:

* embedding lookup 2 b s: ``ops.take`` wraps negative ids (``i < 0``, ``i + V``);
* causal mask per block s + s^2 + b s^2: ``compute_causal_mask`` adds the cache index to
  ``arange(s)`` (s), ``i >= j`` (s^2); ``ops.minimum`` with the padding mask (b s^2);
* masked softmax (keras ``Softmax`` layer) b s^2 + 5 b n s^2: ``mask > 0.5`` on the
  (b, 1, s, s) mask, Softmax; the two ``where`` are selects (0);
* attention scores and context 4 b n s^2 d; residual adds b s h each, two per block.

GPT-2 (dropout 0.1, training): LayerNorm 9 b s h + 4 b s (Mean, SquaredDifference 2,
Mean, x*inv, inv*gamma, -mean*inv, +beta, +: 9 b s h; eps Add, Rsqrt 2, Neg: 4 b s);
Dropout(N elements) 4 N + 7 (x * 1/keep, uniform*range, +min, >= rate: 4 N; the range
max-min 1; SeedGenerator ``state * 1``, ``+ [0, 1]``, ``floormod`` on 2 ints: 6); the
self-attention (keras MultiHeadAttention subclass: one entry) q/k/v 3 (2 b s h n d +
b s n d) (EinsumDense + bias), query scale b s n d, 4 b n s^2 d, masked softmax, its
dropout 4 b n s^2 + 7, output 2 b s n d h + b s h; MLP up 2 b s h f + b s f + 8 b s f
(bias, tanh-GELU: pow, 3 mul, 2 add, tanh, mul), down 2 b s f h + b s h; top 2 b s
(lookup) + b s h (token + position add) + dropout(b s h) + final LayerNorm. Total:
2bs + bsh + (4bsh + 7) + (9bsh + 4bs) + L[s + s^2 + bs^2 + 2bsh + 2(9bsh + 4bs)
+ 8bshnd + 4bsnd + bsh + 4bns^2d + bs^2 + 9bns^2 + 7 + 4bshf + 9bsf + bsh + 2(4bsh + 7)].

Llama 3 (no bias, dropout 0: Dropout is the identity): LlamaLayerNorm 4 b s h + 3 b s
(pow, Mean, x*rsqrt, *scale; eps Add, Rsqrt 2); q 2 b s h n d, k and v 2 b s h k d each,
output 2 b s n d h; attention's own ops 2 + 4 b n s^2 d + b n s^2 (``ops.repeat``'s two
size products, scores * 1/sqrt(d)); RoPE per call on m heads rope(m) = 3 d/2 + s + s d/2
+ 2 s d + 7 b s m d/2 (inverse frequencies: /d, pow, 1/x; positions + start; the outer
product ``bi,j->bij`` s d/2; cos, sin s d each; -x2 b s m d/2; x cos, rot sin, + 3 b s m
d), called for the query (m = n) and the key (m = k); gate, up, down 2 b s h f each; the
block's own SiLU 3 b s f (beta Mul, Sigmoid, Mul) and gate*up b s f. Total:
2bs + (4bsh + 3bs) + L[s + s^2 + bs^2 + 2bsh + 4bsf + 2(4bsh + 3bs) + 2bsh(2n + 2k)d
+ 2 + 4bns^2d + bns^2 + rope(n) + rope(k) + bs^2 + 5bns^2 + 6bshf].

Gemma (no bias, dropout 0): RMSNormalization 4 b s h + 3 b s + h (square, Mean,
x*reciprocal, *(1+scale); eps Add, Sqrt, Reciprocal; 1 + scale on h); projections as
Llama's; attention's own ops b s n d + 4 b n s^2 d + 2 b s^2 - b s (query * 1/sqrt(d);
the "no attended token" check ``all(mask == 0, -1)``: Equal b s^2, All b s^2 - b s);
rope(m) as Llama's but 2 d for the inverse frequencies (/d, neg, pow, /scaling factor);
the block's own tanh-GELU 8 b s f and gate product b s f; the embedding scale
``x * sqrt(h)`` b s h. Total: 2bs + bsh + (4bsh + 3bs + h) + L[s + s^2 + bs^2 + 2bsh
+ 9bsf + 2(4bsh + 3bs + h) + 2bsh(2n + 2k)d + bsnd + 4bns^2d + 2bs^2 - bs + rope(n)
+ rope(k) + bs^2 + 5bns^2 + 6bshf].

Where the profile departs from the architecture (found here, kept visible):
Gemma's embedding scale is a ``keras.ops`` call between layers of the backbone's
functional graph, so it is in no entry (a warning, b s h FLOPs missing from the total);
Gemma's attention builds a Dropout it calls only when dropout > 0, listed in
``not_counted`` as "not called"; and Gemma's blocks keep their declared sub-layer order,
not the call order, because the replay in ``profiler.signature.call_order`` fails on the
KerasTensor that feeds them (marked ``sparse=True`` by Keras' Multiply spec for ``x *
tensor``), see ``test_gemma_sub_layers_in_call_order``.
"""
from __future__ import annotations

import math

import keras
import pytest
import tensorflow as tf
from keras import ops

from tfplan.profiler.static import profile_model

keras_hub = pytest.importorskip("keras_hub")

B, S, V, L, H, N, D, F = 2, 12, 128, 2, 32, 4, 8, 64  # b s != h, s^2 != h: terms stay apart
P = 16  # GPT-2 max_sequence_length (its position table), more than S
K_LLAMA = 2
K_GEMMA, D_GEMMA, F_GEMMA = 1, 16, 48  # Gemma's intermediate_dim 96 -> two gates of 48

MASK = S + S * S + B * S * S  # compute_causal_mask and the merge with the padding mask
SOFTMAX = B * S * S + 5 * B * N * S * S  # mask > 0.5, Softmax
CORE = 4 * B * N * S * S * D  # scores and context (D * N = h for GPT-2 and Llama)


def wrap(backbone):
    ids = keras.Input((S,), dtype="int32", name="token_ids")
    pm = keras.Input((S,), dtype="int32", name="padding_mask")
    return keras.Model([ids, pm], backbone({"token_ids": ids, "padding_mask": pm}))


def dense_flops(n_in: int, n_out: int) -> int:
    """A projection of b s tokens: one multiply-add per weight per token."""
    return 2 * B * S * n_in * n_out


def dropout(elements: int) -> int:
    return 4 * elements + 7


def layer_norm() -> int:
    return 9 * B * S * H + 4 * B * S


def llama_norm() -> int:
    return 4 * B * S * H + 3 * B * S


def gemma_norm() -> int:
    return 4 * B * S * H + 3 * B * S + H


def rope(heads: int, d: int, inverse_freq_ops: int) -> int:
    return (inverse_freq_ops * d // 2 + S + S * d // 2 + 2 * S * d
            + 7 * B * S * heads * d // 2)


# --- the models: (entry name, the layer, whether it is a block) in call order --------------
def gpt2_entries(bb) -> list[tuple[str, object, bool]]:
    g = bb.name
    out = [(f"{g}/token_embedding", bb.token_embedding, False),
           (f"{g}/position_embedding", bb.position_embedding, False),
           (f"{g}/embeddings_add", bb.embeddings_add, False),
           (f"{g}/embeddings_dropout", bb.embeddings_dropout, False)]
    for blk in bb.transformer_layers:
        p = f"{g}/{blk.name}"
        out += [(p, blk, True)] + [(f"{p}/{layer.name}", layer, False) for layer in (
            blk._self_attention_layer_norm, blk._self_attention_layer,
            blk._self_attention_dropout, blk._feedforward_layer_norm,
            blk._feedforward_intermediate_dense, blk._feedforward_output_dense,
            blk._feedforward_dropout)]
    return out + [(f"{g}/layer_norm", bb.layer_norm, False)]


def llama_entries(bb) -> list[tuple[str, object, bool]]:
    g = bb.name
    out = [(f"{g}/token_embedding", bb.token_embedding, False)]
    for blk in bb.transformer_layers:
        p, attn = f"{g}/{blk.name}", blk._self_attention_layer
        a = f"{p}/{attn.name}"
        out += [(p, blk, True), (f"{p}/{blk._self_attention_layernorm.name}",
                                 blk._self_attention_layernorm, False), (a, attn, True)]
        out += [(f"{a}/{layer.name}", layer, False) for layer in (
            attn._query_dense, attn.rotary_embedding_layer, attn._key_dense,
            attn._value_dense, attn._softmax, attn._dropout_layer, attn._output_dense)]
        out += [(f"{p}/{layer.name}", layer, False) for layer in (
            blk._self_attention_dropout, blk._feedforward_layernorm,
            blk._feedforward_gate_dense, blk._feedforward_intermediate_dense,
            blk._feedforward_output_dense)]
    return out + [(f"{g}/{bb.layer_norm.name}", bb.layer_norm, False)]


def gemma_entries(bb) -> list[tuple[str, object, bool]]:
    g = bb.name
    out = [(f"{g}/token_embedding", bb.token_embedding, False)]
    for blk in bb.transformer_layers:
        p, attn = f"{g}/{blk.name}", blk.attention
        a = f"{p}/{attn.name}"
        out += [(p, blk, True), (f"{p}/{blk.pre_attention_norm.name}",
                                 blk.pre_attention_norm, False), (a, attn, True)]
        # the call order; the dropout is never called (dropout 0): listed after them
        out += [(f"{a}/{layer.name}", layer, False) for layer in (
            attn.query_dense, attn.rope_layer, attn.key_dense, attn.value_dense,
            attn.softmax, attn.output_dense, attn.dropout_layer)]
        out += [(f"{p}/{layer.name}", layer, False) for layer in (
            blk.pre_ffw_norm, blk.gating_ffw, blk.gating_ffw_2, blk.ffw_linear)]
    return out + [(f"{g}/{bb.layer_norm.name}", bb.layer_norm, False)]


def _profiled(make, entries):
    """Profile of the wrapped backbone and, per expected entry, (name, params, is_block)."""
    with tf.Graph().as_default():
        backbone = make()
        model = wrap(backbone)
        found, listed = entries(backbone), []
        for name, layer, block in found:
            if block:  # its own weights: those no entry inside it holds
                inner = {id(w) for n, sub, _ in found if n.startswith(name + "/")
                         for w in sub.weights}
                own = sum(math.prod(w.shape) for w in layer.weights if id(w) not in inner)
            else:
                own = layer.count_params()
            listed.append((name, own, block))
        return profile_model(model, B, optimizer="sgd"), model.count_params(), listed


@pytest.fixture(scope="module")
def gpt2():
    return _profiled(lambda: keras_hub.models.GPT2Backbone(
        vocabulary_size=V, num_layers=L, num_heads=N, hidden_dim=H, intermediate_dim=F,
        max_sequence_length=P), gpt2_entries)


@pytest.fixture(scope="module")
def llama():
    return _profiled(lambda: keras_hub.models.Llama3Backbone(
        vocabulary_size=V, num_layers=L, num_query_heads=N, num_key_value_heads=K_LLAMA,
        hidden_dim=H, intermediate_dim=F), llama_entries)


@pytest.fixture(scope="module")
def gemma():
    return _profiled(lambda: keras_hub.models.GemmaBackbone(
        vocabulary_size=V, num_layers=L, num_query_heads=N, num_key_value_heads=K_GEMMA,
        hidden_dim=H, intermediate_dim=2 * F_GEMMA, head_dim=D_GEMMA), gemma_entries)


def check_params(profile, count_params, listed, closed_form):
    assert {l.name: l.params for l in profile.layers} == {n: p for n, p, _ in listed}
    assert profile.params == count_params == closed_form
    for name, _, block in listed:  # keras_hub's blocks hold no weights of their own
        assert not block or profile.layer(name).params == 0


# --- GPT-2 ------------------------------------------------------------------------------
def gpt2_flops(g: str, blocks: list[str]) -> dict[str, int]:
    attention = (3 * (dense_flops(H, N * D) + B * S * N * D) + B * S * N * D + CORE
                 + SOFTMAX + dropout(B * N * S * S) + dense_flops(N * D, H) + B * S * H)
    out = {f"{g}/token_embedding": 2 * B * S, f"{g}/position_embedding": 0,
           f"{g}/embeddings_add": B * S * H, f"{g}/embeddings_dropout": dropout(B * S * H),
           f"{g}/layer_norm": layer_norm()}
    for p in blocks:
        out.update({
            p: MASK + 2 * B * S * H,
            f"{p}/self_attention_layer_norm": layer_norm(),
            f"{p}/self_attention": attention,
            f"{p}/self_attention_dropout": dropout(B * S * H),
            f"{p}/feedforward_layer_norm": layer_norm(),
            f"{p}/feedforward_intermediate_dense": dense_flops(H, F) + B * S * F + 8 * B * S * F,
            f"{p}/feedforward_output_dense": dense_flops(F, H) + B * S * H,
            f"{p}/feedforward_dropout": dropout(B * S * H)})
    return out


def test_gpt2_params_flops_and_structure(gpt2):
    profile, count_params, listed = gpt2
    g = listed[0][0].split("/")[0]
    blocks = [f"{g}/transformer_layer_{i}" for i in range(L)]
    check_params(profile, count_params, listed, V * H + P * H + L * (
        2 * H + 3 * (H * N * D + N * D) + N * D * H + H + 2 * H + H * F + F + F * H + H)
        + 2 * H)

    expected = gpt2_flops(g, blocks)
    assert {l.name: l.flops_fwd for l in profile.layers} == expected
    assert profile.flops_fwd == sum(expected.values()) == (
        2 * B * S + B * S * H + dropout(B * S * H) + layer_norm() + L * (
            MASK + 2 * B * S * H + 2 * layer_norm() + 8 * B * S * H * N * D
            + 4 * B * S * N * D + B * S * H + CORE + B * S * S + 9 * B * N * S * S + 7
            + 4 * B * S * H * F + 9 * B * S * F + B * S * H + 2 * dropout(B * S * H)))
    assert profile.not_counted == () and profile.warnings == ()
    assert profile.opaque_blocks == () and profile.blocks == tuple(blocks)
    assert [l.name for l in profile.layers] == [n for n, _, _ in listed]  # call order

    for p in blocks:
        attn = profile.layer(f"{p}/self_attention")
        # keras_hub's CachedMultiHeadAttention derives from MultiHeadAttention: the planner
        # treats it as one (one entry, no sub-layer entries for its projections)
        assert (attn.type, attn.base_type, attn.kind) == (
            "CachedMultiHeadAttention", "MultiHeadAttention", "MultiHeadAttention")
        assert attn.attention_kv_heads == N
        assert attn.matmul_flops_fwd == 3 * dense_flops(H, N * D) + CORE + dense_flops(N * D, H)
        assert not any(l.name.startswith(f"{p}/self_attention/") for l in profile.layers)
        assert profile.layer(p).type == "TransformerDecoder"
        assert profile.layer(f"{p}/feedforward_intermediate_dense").matmul_flops_fwd == \
            dense_flops(H, F)
        assert profile.layer(f"{p}/feedforward_output_dense").matmul_flops_fwd == \
            dense_flops(F, H)
        assert all(l.block == p for l in profile.layers
                   if l.name == p or l.name.startswith(p + "/"))
    assert all(l.block == "" for l in profile.layers if "/transformer_layer_" not in l.name)


# --- Llama 3 ----------------------------------------------------------------------------
def llama_flops(listed) -> dict[str, int]:
    k = K_LLAMA
    names = [n for n, _, _ in listed]
    out = {names[0]: 2 * B * S, names[-1]: llama_norm()}
    for name in names[1:-1]:
        leaf = name.rsplit("/", 1)[1]
        out[name] = {
            "self_attention_layernorm": llama_norm(), "feedforward_layernorm": llama_norm(),
            "self_attention": 2 + CORE + B * N * S * S,
            "query": dense_flops(H, N * D), "key": dense_flops(H, k * D),
            "value": dense_flops(H, k * D), "attention_output": dense_flops(N * D, H),
            "attention_softmax": SOFTMAX,
            "feedforward_gate_dense": dense_flops(H, F),
            "feedforward_intermediate_dense": dense_flops(H, F),
            "feedforward_output_dense": dense_flops(F, H),
        }.get(leaf, 0)  # dropouts of rate 0 are the identity
        if leaf.startswith("transformer_layer_"):
            out[name] = MASK + 2 * B * S * H + 3 * B * S * F + B * S * F
        elif leaf.startswith("llama_rotary_embedding"):
            out[name] = rope(N, D, 3) + rope(k, D, 3)
    return out


def test_llama3_params_flops_and_structure(llama):
    profile, count_params, listed = llama
    k = K_LLAMA
    g = listed[0][0].split("/")[0]
    blocks = [f"{g}/transformer_layer_{i}" for i in range(L)]
    check_params(profile, count_params, listed, 2 * V * H + L * (
        2 * H + H * N * D + 2 * H * k * D + N * D * H + 3 * H * F) + H)

    expected = llama_flops(listed)
    assert {l.name: l.flops_fwd for l in profile.layers} == expected
    assert profile.flops_fwd == sum(expected.values()) == (
        2 * B * S + llama_norm() + L * (
            MASK + 2 * B * S * H + 4 * B * S * F + 2 * llama_norm()
            + 2 * B * S * H * (2 * N + 2 * k) * D + 2 + CORE + B * N * S * S
            + rope(N, D, 3) + rope(k, D, 3) + SOFTMAX + 6 * B * S * H * F))
    assert profile.not_counted == () and profile.warnings == ()
    assert profile.opaque_blocks == () and profile.blocks == tuple(blocks)
    assert [l.name for l in profile.layers] == [n for n, _, _ in listed]  # call order

    for p in blocks:
        a = f"{p}/self_attention"
        assert profile.layer(a).type == "LlamaAttention" and profile.layer(a).kind == \
            "LlamaAttention"
        for sub, n_in, n_out in (("query", H, N * D), ("key", H, k * D), ("value", H, k * D),
                                 ("attention_output", N * D, H)):
            entry = profile.layer(f"{a}/{sub}")
            assert entry.type == "EinsumDense" and entry.block == p
            assert entry.flops_fwd == entry.matmul_flops_fwd == dense_flops(n_in, n_out)
        for sub, n_in, n_out in (("feedforward_gate_dense", H, F),
                                 ("feedforward_intermediate_dense", H, F),
                                 ("feedforward_output_dense", F, H)):
            entry = profile.layer(f"{p}/{sub}")
            assert entry.type == "Dense" and entry.block == p
            assert entry.flops_fwd == entry.matmul_flops_fwd == dense_flops(n_in, n_out)
        assert all(l.block == p for l in profile.layers
                   if l.name == p or l.name.startswith(p + "/"))
        assert all(not l.opaque for l in profile.layers)


# --- Gemma ------------------------------------------------------------------------------
def gemma_flops(listed) -> dict[str, int]:
    k, d, f = K_GEMMA, D_GEMMA, F_GEMMA
    core = 4 * B * N * S * S * d
    names = [n for n, _, _ in listed]
    out = {names[0]: 2 * B * S, names[-1]: gemma_norm()}
    for name in names[1:-1]:
        leaf = name.rsplit("/", 1)[1]
        out[name] = {
            "pre_attention_norm": gemma_norm(), "pre_ffw_norm": gemma_norm(),
            "attention": B * S * N * d + core + 2 * B * S * S - B * S,
            "query": dense_flops(H, N * d), "key": dense_flops(H, k * d),
            "value": dense_flops(H, k * d), "attention_output": dense_flops(N * d, H),
            "ffw_gating": dense_flops(H, f),
            "ffw_gating_2": dense_flops(H, f), "ffw_linear": dense_flops(f, H),
        }.get(leaf, 0)  # the attention's dropout is never called
        if leaf.startswith("decoder_block_"):
            out[name] = MASK + 2 * B * S * H + 8 * B * S * f + B * S * f
        elif leaf.startswith("rotary_embedding"):
            out[name] = rope(N, d, 4) + rope(k, d, 4)
        elif leaf.startswith("softmax"):  # an unnamed keras Softmax: softmax, softmax_1...
            out[name] = SOFTMAX
    return out


def test_gemma_params_flops_and_structure(gemma):
    profile, count_params, listed = gemma
    k, d, f = K_GEMMA, D_GEMMA, F_GEMMA
    g = listed[0][0].split("/")[0]
    blocks = [f"{g}/decoder_block_{i}" for i in range(L)]
    check_params(profile, count_params, listed, V * H + L * (
        2 * H + H * N * d + 2 * H * k * d + N * d * H + 3 * H * f) + H)

    expected = gemma_flops(listed)
    assert {l.name: l.flops_fwd for l in profile.layers} == expected
    scale = B * S * H  # GemmaBackbone's x * sqrt(h), between layers: in no entry
    closed_form = 2 * B * S + scale + gemma_norm() + L * (
        MASK + 2 * B * S * H + 9 * B * S * f + 2 * gemma_norm()
        + 2 * B * S * H * (2 * N + 2 * k) * d + B * S * N * d + 4 * B * N * S * S * d
        + 2 * B * S * S - B * S + rope(N, d, 4) + rope(k, d, 4) + SOFTMAX + 6 * B * S * H * f)
    assert profile.flops_fwd == sum(expected.values()) == closed_form - scale
    assert len(profile.warnings) == 1
    assert "op(s) created outside any layer" in profile.warnings[0]
    assert f"/Mul (Mul): {scale} FLOPs" in profile.warnings[0]
    # CachedGemmaAttention builds a Dropout it calls only when dropout > 0
    dropouts = [n for n, _, _ in listed if n.rsplit("/", 1)[1].startswith("dropout")]
    assert len(dropouts) == L
    assert profile.not_counted == tuple(
        f"{n}: not called in the model's training step: no activations or FLOPs"
        for n in dropouts)
    assert profile.opaque_blocks == () and profile.blocks == tuple(blocks)

    for p in blocks:
        a = f"{p}/attention"
        assert profile.layer(a).type == "CachedGemmaAttention"
        for sub, n_in, n_out in (("query", H, N * d), ("key", H, k * d), ("value", H, k * d),
                                 ("attention_output", N * d, H)):
            entry = profile.layer(f"{a}/{sub}")
            assert entry.type == "EinsumDense" and entry.block == p
            assert entry.flops_fwd == entry.matmul_flops_fwd == dense_flops(n_in, n_out)
        for sub, n_in, n_out in (("ffw_gating", H, f), ("ffw_gating_2", H, f),
                                 ("ffw_linear", f, H)):
            entry = profile.layer(f"{p}/{sub}")
            assert entry.type == "EinsumDense" and entry.block == p
            assert entry.flops_fwd == entry.matmul_flops_fwd == dense_flops(n_in, n_out)
        assert all(l.block == p for l in profile.layers
                   if l.name == p or l.name.startswith(p + "/"))


def test_gemma_sub_layers_in_call_order(gemma):
    profile, _, listed = gemma
    assert [l.name for l in profile.layers] == [n for n, _, _ in listed]


# --- user-defined blocks ----------------------------------------------------------------
class MLPBlock(keras.layers.Layer):
    """A block: two Dense sub-layers and a residual add (made down first, called up first)."""

    def __init__(self, hidden: int, **kwargs):
        super().__init__(**kwargs)
        self.down = keras.layers.Dense(hidden, name="down")
        self.up = keras.layers.Dense(4 * hidden, name="up")

    def call(self, x):
        return x + self.down(self.up(x))


class OwnKernel(keras.layers.Layer):
    """A custom layer that multiplies a weight it holds itself."""

    def build(self, shape):
        self.kernel = self.add_weight(shape=(shape[-1], shape[-1]), name="kernel")

    def call(self, x):
        return ops.matmul(x, self.kernel)


class GatedBlock(keras.layers.Layer):
    """A block with a sub-layer and a weight of its own that it multiplies."""

    def __init__(self, hidden: int, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(hidden, use_bias=False, name="proj")

    def build(self, shape):
        self.gate = self.add_weight(shape=(shape[-1], shape[-1]), name="gate")

    def call(self, x):
        return self.proj(x) * ops.matmul(x, self.gate)


def test_custom_block_has_entries_for_its_sub_layers():
    h = 8
    with tf.Graph().as_default():
        x = keras.Input((S, h))
        model = keras.Model(x, MLPBlock(h, name="block")(x))
        profile = profile_model(model, B, optimizer="sgd")
        assert profile.params == model.count_params()
    assert [(l.name, l.type, l.block, l.params, l.flops_fwd, l.matmul_flops_fwd)
            for l in profile.layers] == [
        ("block", "MLPBlock", "block", 0, B * S * h, 0),  # the residual add
        ("block/up", "Dense", "block", h * 4 * h + 4 * h,
         dense_flops(h, 4 * h) + B * S * 4 * h, dense_flops(h, 4 * h)),  # + BiasAdd
        ("block/down", "Dense", "block", 4 * h * h + h,
         dense_flops(4 * h, h) + B * S * h, dense_flops(4 * h, h))]
    assert profile.blocks == ("block",)
    assert profile.opaque_blocks == () and profile.not_counted == () and profile.warnings == ()


def test_custom_layers_multiplying_their_own_weights_are_opaque():
    h = 8
    with tf.Graph().as_default():
        x = keras.Input((S, h))
        y = OwnKernel(name="mix")(x)
        model = keras.Model(x, GatedBlock(h, name="gated")(y))
        profile = profile_model(model, B, optimizer="sgd")
    assert [(l.name, l.block, l.params, l.flops_fwd) for l in profile.layers] == [
        ("mix", "", h * h, dense_flops(h, h)),
        ("gated", "gated", h * h, dense_flops(h, h) + B * S * h),  # its matmul and the product
        ("gated/proj", "gated", h * h, dense_flops(h, h))]
    opaque = dict(profile.opaque_blocks)
    assert list(opaque) == ["mix", "gated"]
    assert opaque["mix"].startswith("custom layer OwnKernel multiplies weights it holds "
                                    "itself (")
    assert opaque["gated"].startswith("custom block GatedBlock multiplies weights it holds "
                                      "itself (")
    assert all("stays whole (replicated)" in why for why in opaque.values())
    assert not profile.layer("gated/proj").opaque
    assert profile.not_counted == ()
