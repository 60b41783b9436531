"""Mixture-of-experts layers through the profiler (``profiler.moe``): routed FLOPs in closed
form, exact parameters, the ``moe_*`` fields, the not-recognised warning, JSON round trip,
and a trillion-parameter MoE profiled symbolically.

Symbols: T = b s tokens, d width, E experts, k top_k, h expert width, C rows per expert of
our layer's dispatch buffer (T, or ceil(cf T k / E)), R = min(T k, E C) routed rows.
float32, ``profiler.op_flops``' rules (a multiply-add 2, each element-wise op 1 per output
element, Softmax 5 per element, reductions in - out, Cumsum out).

Our ``MixtureOfExperts`` (GELU, biases): per expert row 4 d h (two contractions) + h + d
(bias adds) + 5 h (exact GELU: Mul, Neg, Mul, Erfc, Mul). Its own routing ops
(``tfplan.layers.routing``, as traced): the router 2 T d E, Softmax 5 T E, the top-k choice
T (E - k) (``profiler.moe``), the gates' normalisation for k > 1 (Sum T k - T, RealDiv T k),
the GShard slots 3 k T E - k T + 3 k T (Cumsum, Mul and Sum over the one-hot, Less, Mul,
Add) + 5 scalar ops on the buffer's sizes (+ 3 with a capacity factor: ``capacity``'s
Mul, Ceil and Maximum), and the combine 2 T k d - T d (gate Mul, Sum over the k choices).

keras_hub's Mixtral expert bank per row (every expert on every token as written): 6 d h
(gate, up, down) + 3 h (SiLU: Mul, Sigmoid, Mul) + h (gate x up). Qwen-MoE's: its gate and
up in one [E, d, 2h] kernel (4 d h) + the down 2 h d, SiLU 3 h and the product h.
"""
from __future__ import annotations

import math
import time

import keras
import pytest
import tensorflow as tf

from tfplan.layers import MixtureOfExperts
from tfplan.profiler.model_profile import MOE_FIELDS, ModelProfile
from tfplan.profiler.static import profile_and_trace, profile_model

B, S, D, E, H = 2, 6, 8, 4, 16
T = B * S


def capacity(k: int, cf: float | None) -> int:
    return T if cf is None else max(1, math.ceil(cf * T * k / E))


def per_row() -> int:
    return 4 * D * H + H + D + 5 * H


def routing(k: int, cf: float | None) -> int:
    """Our layer's ops outside the experts (module docstring)."""
    return (2 * T * D * E + 5 * T * E + T * (E - k) + (2 * T * k - T if k > 1 else 0)
            + 3 * k * T * E - k * T + 3 * k * T + 5 + (3 if cf else 0)
            + 2 * T * k * D - T * D)


def our_model(k: int, cf: float | None):
    x = keras.Input((S, D))
    y = keras.layers.Dense(D, name="before")(x)  # the layer's input needs a gradient
    y = MixtureOfExperts(E, k, H, capacity_factor=cf, name="moe")(y)
    return keras.Model(x, y, name="tiny_moe")


@pytest.mark.parametrize("k,cf", [(1, None), (2, None), (2, 1.25), (1, 0.5)])
def test_our_layer_routed_flops_in_closed_form(k, cf):
    with tf.Graph().as_default():
        model = our_model(k, cf)
        layer = model.get_layer("moe")
        p = profile_model(model, B, optimizer="sgd")
        moe = p.layer("moe")
        assert moe.params == layer.count_params() == D * E + E * (2 * D * H + H + D)
        assert p.params == model.count_params()
    executed_rows, routed_rows = E * capacity(k, cf), min(T * k, E * capacity(k, cf))
    assert (moe.moe_experts, moe.moe_top_k, moe.moe_tokens) == (E, k, T)
    assert moe.moe_expert_params == E * (2 * D * H + H + D)
    assert moe.moe_capacity_factor == (cf or 0.0)
    assert moe.moe_dispatch_bytes == T * k * D * 4
    assert moe.moe_expert_flops_fwd == routed_rows * per_row()
    executed = executed_rows * per_row()
    assert moe.moe_executed_flops_fwd == (executed if executed > routed_rows * per_row() else 0)
    assert moe.flops_fwd == routing(k, cf) + routed_rows * per_row()
    assert moe.matmul_flops_fwd == 2 * T * D * E + routed_rows * 4 * D * H
    assert moe.matmul_flops_bwd == 2 * moe.matmul_flops_fwd  # input and weight gradients
    assert moe.not_counted == ()  # the top-k and the combine's data-dependent gradient
    assert moe.is_moe and not p.layer("before").is_moe
    assert not any("mixture of experts" in w for w in p.warnings)


def test_every_expert_chosen_is_the_layer_as_written():
    """k = E with no capacity: the routing asks for every row the layer runs, so the
    profile is the trace as written (plus the top-k choice: 0 comparisons)."""
    with tf.Graph().as_default():
        p, trace = profile_and_trace(our_model(E, None), B, optimizer="sgd")
    moe = p.layer("moe")
    traced = {ph: sum(r.flops for r in trace.ops if r.owner == "moe" and r.phase == ph)
              for ph in ("fwd", "bwd")}
    assert moe.flops_fwd == traced["fwd"] == routing(E, None) + E * T * per_row()
    assert moe.moe_executed_flops_fwd == 0 and moe.moe_expert_flops_fwd == E * T * per_row()
    # the combine's gradient keeps all T k choices: its two data-dependent ops priced so
    assert moe.flops_bwd == traced["bwd"] + T * E + T * E * D


def test_profile_round_trips_through_json():
    with tf.Graph().as_default():
        p = profile_model(our_model(2, 1.25), B, optimizer="sgd")
    doc = p.to_dict()
    again = ModelProfile.from_dict(doc)
    assert again == p
    moe_doc = next(l for l in doc["layers"] if l["name"] == "moe")
    assert moe_doc["moe_capacity_factor"] == 1.25 and moe_doc["moe_top_k"] == 2
    assert "moe_experts" not in next(l for l in doc["layers"] if l["name"] == "before")


class TopKWithoutRouter(keras.layers.Layer):
    """Looks like an MoE (a top-k op, stacked [E, d, h] weights) but has no router: its
    scores are the input's first E features."""

    def build(self, shape):
        self.w = self.add_weight(shape=(E, shape[-1], H), name="w")
        self.v = self.add_weight(shape=(E, H, shape[-1]), name="v")

    def call(self, x):
        flat = tf.reshape(x, [-1, x.shape[-1]])
        gates, _ = tf.math.top_k(flat[:, :E], k=2)
        y = tf.einsum("ehd,ech->ecd", self.v, tf.einsum("td,edh->eth", flat, self.w))
        return tf.reshape(tf.reduce_sum(y, 0), tf.shape(x)) * tf.reduce_sum(gates)


def test_a_layer_that_looks_like_an_moe_but_is_not_recognised_is_named():
    with tf.Graph().as_default():
        x = keras.Input((S, D))
        model = keras.Model(x, TopKWithoutRouter(name="odd")(x))
        p = profile_model(model, B, optimizer="sgd")
    (warning,) = [w for w in p.warnings if "looks like a mixture of experts" in w]
    assert "layer odd" in warning and "no router" in warning and f"{E} units" in warning
    assert not p.layer("odd").is_moe


class DenseMoE(keras.layers.Layer):
    """An MoE written densely in one layer (every expert on every token, weighted by the
    router's top-k gates): a router weight of its own, a ``top_k`` attribute, stacked
    experts. Recognised by structure; its experts' ops are found in its entry by shape."""

    top_k = 2

    def build(self, shape):
        d = shape[-1]
        self.router = self.add_weight(shape=(d, E), name="router")
        self.w_in = self.add_weight(shape=(E, d, H), name="w_in")
        self.w_out = self.add_weight(shape=(E, H, d), name="w_out")

    def call(self, x):
        flat = tf.reshape(x, [-1, x.shape[-1]])
        probs = tf.nn.softmax(tf.matmul(flat, self.router))
        top, chosen = tf.math.top_k(probs, k=self.top_k)
        gates = tf.reduce_sum(tf.one_hot(chosen, E) * top[..., None], axis=1)  # [T, E]
        y = tf.einsum("eth,ehd->etd", tf.nn.relu(tf.einsum("td,edh->eth", flat, self.w_in)),
                      self.w_out)
        out = tf.reduce_sum(y * tf.transpose(gates)[..., None], axis=0)
        return tf.reshape(out, tf.shape(x))


def test_a_dense_moe_of_its_own_weights_is_recognised_by_structure():
    with tf.Graph().as_default():
        x = keras.Input((S, D))
        y = keras.layers.Dense(D, name="before")(x)
        layer = DenseMoE(name="dense_moe")
        model = keras.Model(x, layer(y))
        p = profile_model(model, B, optimizer="sgd")
        assert p.layer("dense_moe").params == layer.count_params()
    moe = p.layer("dense_moe")
    # per row: the two contractions, ReLU, and the gate Mul on the expert's output
    row = 4 * D * H + H + D
    assert (moe.moe_experts, moe.moe_top_k, moe.moe_tokens) == (E, 2, T)
    assert moe.moe_expert_params == 2 * E * D * H
    assert moe.moe_expert_flops_fwd == T * 2 * row
    assert moe.moe_executed_flops_fwd == E * T * row
    # router, Softmax, top-k, one-hot x top (T k E) and its sum (T k E - T E), the sum
    # over the experts ((E - 1) T d), and the routed experts
    assert moe.flops_fwd == (2 * T * D * E + 5 * T * E + T * (E - 2) + T * 2 * E
                             + T * 2 * E - T * E + (E - 1) * T * D + T * 2 * row)
    assert moe.not_counted == ()


# --- keras_hub ----------------------------------------------------------------------------
L, N, KV, F_HUB, V = 2, 4, 2, 24, 64


def hub_profile(make):
    keras_hub = pytest.importorskip("keras_hub")
    with tf.Graph().as_default():
        backbone = make(keras_hub)
        ids = keras.Input((S,), dtype="int32", name="token_ids")
        pm = keras.Input((S,), dtype="int32", name="padding_mask")
        model = keras.Model([ids, pm], backbone({"token_ids": ids, "padding_mask": pm}))
        p = profile_model(model, B, optimizer="sgd")
        return p, model.count_params(), backbone


def _moe_blocks(p, backbone):
    """(entry name, layer) of each Mixtral sparse MoE block, checking its entry holds no
    weights of its own and its expert bank's entry all of the bank's."""
    for blk in backbone.transformer_layers:
        moe = blk._sparse_moe_block
        prefix = f"{backbone.name}/{blk.name}/{moe.name}"
        assert p.layer(prefix).params == 0
        assert p.layer(f"{prefix}/{moe.expert_bank.name}").params == \
            moe.expert_bank.count_params()
        yield prefix, moe


@pytest.mark.parametrize("k", [1, 2])
def test_mixtral_expert_bank_priced_by_routed_tokens(k):
    HID = 32
    p, total, bb = hub_profile(lambda hub: hub.models.MixtralBackbone(
        vocabulary_size=V, num_layers=L, num_query_heads=N, num_key_value_heads=KV,
        hidden_dim=HID, intermediate_dim=F_HUB, num_experts=E, top_k=k, sliding_window=S))
    assert p.params == total
    row = 6 * HID * F_HUB + 4 * F_HUB
    entries = list(_moe_blocks(p, bb))
    assert len(entries) == L
    for prefix, moe in entries:
        block = p.layer(prefix)
        router = p.layer(f"{prefix}/{moe._sparse_feedforward_gate_dense.name}")
        bank = p.layer(f"{prefix}/{moe.expert_bank.name}")
        assert not block.is_moe and not router.is_moe and bank.is_moe
        assert router.flops_fwd == 2 * T * HID * E
        assert (bank.moe_experts, bank.moe_top_k, bank.moe_tokens) == (E, k, T)
        assert bank.moe_expert_params == bank.params == 3 * E * HID * F_HUB
        assert bank.moe_expert_flops_fwd == bank.flops_fwd == T * k * row
        assert bank.moe_executed_flops_fwd == E * T * row
        assert bank.matmul_flops_fwd == T * k * 6 * HID * F_HUB
        assert bank.matmul_flops_bwd == 2 * bank.matmul_flops_fwd
        assert bank.moe_dispatch_bytes == T * k * HID * 4 and bank.moe_capacity_factor == 0.0
        assert block.not_counted == () and bank.not_counted == ()
    assert not any("mixture of experts" in w for w in p.warnings)
    assert ModelProfile.from_dict(p.to_dict()) == p


def test_mixtral_repeated_blocks_traced_once_keep_the_moe_numbers():
    """Big models trace identical blocks once (``profiler.repeats``): the copied entries
    get the same routed pricing as the traced ones."""
    pytest.importorskip("keras_hub")
    from keras_hub.src.models.mixtral.mixtral_decoder import MixtralTransformerDecoder

    profiles = []
    for repeat in (False, True):
        with tf.Graph().as_default():
            ids = keras.Input((S,), dtype="int32", name="token_ids")
            x = keras.layers.Embedding(V, 16, name="embed")(ids)
            for i in range(5):
                x = MixtralTransformerDecoder(
                    intermediate_dim=F_HUB, num_query_heads=N, num_key_value_heads=KV,
                    num_experts=E, top_k=2, sliding_window=S, name=f"decoder_{i}")(x)
            model = keras.Model(ids, x)
            profiles.append(profile_model(model, B, optimizer="sgd", repeat_blocks=repeat))
    whole, once = profiles
    assert any("repeated blocks traced once" in w for w in once.warnings)
    moes = [l for l in whole.layers if l.is_moe]
    assert len(moes) == 5
    fields = ("params", "flops_fwd", "matmul_flops_fwd", "matmul_flops_bwd",
              "memory_traffic_bytes_fwd", *MOE_FIELDS)
    assert [[getattr(l, f) for f in fields] for l in once.layers if l.is_moe] == \
        [[getattr(l, f) for f in fields] for l in moes]
    assert once.flops_fwd == whole.flops_fwd


def test_qwen_moe_expert_bank_and_shared_expert():
    HID, MOE_F, SHARED_F, k = 32, 16, 40, 2
    p, total, bb = hub_profile(lambda hub: hub.models.QwenMoeBackbone(
        vocabulary_size=V, num_layers=L, num_query_heads=N, num_key_value_heads=KV,
        hidden_dim=HID, intermediate_dim=F_HUB, moe_intermediate_dim=MOE_F,
        shared_expert_intermediate_dim=SHARED_F, num_experts=E, top_k=k))
    assert p.params == total
    row = 4 * HID * MOE_F + 2 * MOE_F * HID + 4 * MOE_F
    moes = [l for l in p.layers if l.is_moe]
    assert len(moes) == L
    for bank in moes:
        assert bank.name.endswith("/experts") and bank.type == "QwenMoeExperts"
        assert bank.moe_expert_params == bank.params == E * (2 * HID * MOE_F + MOE_F * HID)
        assert (bank.moe_top_k, bank.moe_tokens) == (k, T)
        assert bank.moe_expert_flops_fwd == bank.flops_fwd == T * k * row
        assert bank.moe_executed_flops_fwd == E * T * row
        block = p.layer(bank.name.rsplit("/", 1)[0])
        assert block.not_counted == ()
        shared = [l for l in p.layers if l.name.startswith(block.name + "/shared_expert_dense/")]
        assert shared and not any(l.is_moe for l in shared)  # the shared expert stays dense
        assert sum(l.matmul_flops_fwd for l in shared) == 3 * 2 * T * HID * SHARED_F


# --- a trillion parameters, symbolically ----------------------------------------------------
def test_trillion_parameter_moe_profiles_without_weights():
    experts, width, hidden, seq = 2048, 1024, 238_419, 8
    start = time.monotonic()
    with tf.Graph().as_default():
        x = keras.Input((seq, width))
        layer = MixtureOfExperts(experts, 2, hidden, capacity_factor=1.0, name="moe")
        model = keras.Model(x, layer(x), name="huge_moe")
        p = profile_model(model, 1, optimizer="sgd")
    elapsed = time.monotonic() - start
    expected = width * experts + experts * (2 * width * hidden + hidden + width)
    moe = p.layer("moe")
    assert moe.params == p.params == expected > 1e12
    assert moe.moe_expert_params == expected - width * experts
    tokens, c = seq, math.ceil(1.0 * seq * 2 / experts)
    row = 4 * width * hidden + hidden + width + 5 * hidden
    assert moe.moe_expert_flops_fwd == min(tokens * 2, experts * c) * row
    assert moe.moe_executed_flops_fwd == experts * c * row
    assert elapsed < 60, f"{elapsed:.0f} s"


# --- plan profile -------------------------------------------------------------------------
def test_plan_profile_shows_the_moe_section_and_json_fields():
    import json
    import os

    from tests.cli.helpers import run

    model = os.path.join(os.path.dirname(__file__), "tiny_moe.py")
    code, out, err = run(["profile", model, "--batch-size", str(B)])
    assert code == 0, err
    section = out[out.index("mixtures of experts"):]
    (row,) = [line for line in section.splitlines() if line.lstrip("│ ").startswith("moe ")]
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    routed = min(T * 2, E * capacity(2, 1.25)) * per_row()
    executed = E * capacity(2, 1.25) * per_row()
    assert cells == ["moe", str(E), "2", "1.25", str(T), f"{E * (2 * D * H + H + D):,}",
                     f"{routed / 1e3:.2f} K", f"{executed / 1e3:.2f} K", f"{T * 2 * D * 4} B"]
    code, out, err = run(["profile", model, "--batch-size", str(B), "--json"])
    assert code == 0, err
    moe = next(l for l in json.loads(out)["layers"] if l["name"] == "moe")
    assert moe["moe_expert_flops_fwd"] == routed and moe["moe_experts"] == E


def test_dispatch_bytes_in_the_compute_dtype():
    """Under mixed precision a token travels in bfloat16: 2 bytes per element, whether the
    model is built under the policy (profile_source) or priced in it (profile_model)."""
    import os

    from tfplan.profiler.loader import load_model_source
    from tfplan.profiler.static import profile_source

    source = load_model_source(os.path.join(os.path.dirname(__file__), "tiny_moe.py"))
    built = profile_source(source, B, precision="mixed_bfloat16").layer("moe")
    with tf.Graph().as_default():
        priced = profile_model(our_model(2, 1.25), B, optimizer="sgd",
                               precision="mixed_bfloat16").layer("moe")
    assert built.moe_dispatch_bytes == priced.moe_dispatch_bytes == T * 2 * D * 2
    assert built.moe_expert_flops_fwd == priced.moe_expert_flops_fwd == T * 2 * per_row()


def test_layer_config_keeps_the_aux_loss_coefficient_mixtrals_config_drops():
    """keras_hub 0.32's MixtralTransformerDecoder.get_config leaves out
    router_aux_loss_coef; the config apply clones from puts the user's value back, so a
    copy does not train with the default 0.02."""
    from keras_hub.src.models.mixtral.mixtral_decoder import MixtralTransformerDecoder

    from tfplan.profiler.signature import layer_config
    decoder = MixtralTransformerDecoder(intermediate_dim=16, num_query_heads=2,
                                        num_key_value_heads=1, num_experts=4, top_k=2,
                                        router_aux_loss_coef=0.5)
    assert "router_aux_loss_coef" not in decoder.get_config()  # the keras_hub bug
    config = layer_config(decoder)
    assert config["router_aux_loss_coef"] == 0.5
    assert MixtralTransformerDecoder.from_config(config).router_aux_loss_coef == 0.5
    default = MixtralTransformerDecoder(intermediate_dim=16, num_query_heads=2,
                                        num_key_value_heads=1, num_experts=4, top_k=2)
    assert "router_aux_loss_coef" not in layer_config(default)  # defaults stay implicit
