"""tfplan.layers.MixtureOfExperts against a per-token NumPy reference (the routing,
capacity drops, gates and experts written out one token at a time), its load-balancing
loss against Switch Transformer's eq. 4, its errors and its serialization."""
from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfplan.layers import MixtureOfExperts
from tfplan.layers import routing

D, E, H = 8, 4, 16


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=-1, keepdims=True)


def reference(layer: MixtureOfExperts, x: np.ndarray) -> tuple[np.ndarray, int]:
    """The layer's output one token at a time, and how many choices were dropped."""
    flat = x.reshape(-1, x.shape[-1]).astype(np.float64)
    k, e = layer.top_k, layer.num_experts
    probs = _softmax(flat @ layer.router_kernel.numpy())
    chosen = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    gates = np.take_along_axis(probs, chosen, 1)
    if layer.normalize_top_k:
        gates = gates / gates.sum(axis=1, keepdims=True)
    t = flat.shape[0]
    cap = t if layer.capacity_factor is None else max(
        1, math.ceil(layer.capacity_factor * t * k / e))
    counts, dropped = np.zeros(e, int), 0
    keep = np.zeros((t, k), bool)
    for j in range(k):  # every token's first choice before any second choice
        for i in range(t):
            keep[i, j] = counts[chosen[i, j]] < cap
            counts[chosen[i, j]] += 1
            dropped += not keep[i, j]
    w_in, b_in, w_out, b_out = (w.numpy().astype(np.float64) for w in layer.expert_weights())
    act = lambda z: keras.activations.gelu(z.astype(np.float32)).numpy().astype(np.float64)
    out = np.zeros_like(flat)
    for i in range(t):
        for j in range(k):
            if keep[i, j]:
                ex = chosen[i, j]
                out[i] += gates[i, j] * (act(flat[i] @ w_in[ex] + b_in[ex]) @ w_out[ex]
                                         + b_out[ex])
    return out.reshape(x.shape), dropped


@pytest.mark.parametrize("top_k,capacity_factor", [(1, None), (2, None), (1, 1.0), (2, 0.5)])
def test_output_equals_the_per_token_reference(top_k, capacity_factor):
    keras.utils.set_random_seed(1)
    x = np.random.default_rng(0).normal(size=(3, 5, D)).astype("float32")
    layer = MixtureOfExperts(E, top_k, H, capacity_factor=capacity_factor, aux_loss_weight=0.0)
    y = layer(x).numpy()
    ref, dropped = reference(layer, x)
    np.testing.assert_allclose(y, ref, atol=2e-6)
    if capacity_factor is None:
        assert dropped == 0
    if capacity_factor == 0.5:  # 15 tokens x 2 choices into 4 experts of 4 rows: some drop
        assert dropped > 0


def test_gates_are_probabilities_for_top1_and_normalised_for_top2():
    assert not MixtureOfExperts(E, 1, H).normalize_top_k
    assert MixtureOfExperts(E, 2, H).normalize_top_k
    assert not MixtureOfExperts(E, 2, H, normalize_top_k=False).normalize_top_k


def test_params_are_router_plus_stacked_experts():
    inp = keras.Input((5, D))
    model = keras.Model(inp, MixtureOfExperts(E, 2, H, name="moe")(inp))
    assert model.count_params() == D * E + E * (D * H + H + H * D + D)
    no_bias = MixtureOfExperts(E, 2, H, use_bias=False)
    no_bias.build((None, 5, D))
    assert no_bias.count_params() == D * E + E * (D * H + H * D)


def test_gradients_reach_router_and_every_used_expert():
    keras.utils.set_random_seed(2)
    x = tf.constant(np.random.default_rng(1).normal(size=(4, 6, D)).astype("float32"))
    layer = MixtureOfExperts(E, 2, H, aux_loss_weight=0.0)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(x) ** 2)
    grads = tape.gradient(loss, layer.trainable_variables)
    assert all(g is not None for g in grads)
    router = grads[0].numpy()
    assert np.abs(router).sum() > 0  # normalised top-2 gates still depend on the router


def test_load_balancing_loss_is_switch_eq4():
    keras.utils.set_random_seed(3)
    x = np.random.default_rng(2).normal(size=(2, 7, D)).astype("float32")
    layer = MixtureOfExperts(E, 2, H, aux_loss_weight=0.5)
    inp = keras.Input((7, D))
    model = keras.Model(inp, layer(inp))
    model(x, training=True)
    flat = x.reshape(-1, D)
    probs = _softmax(flat.astype(np.float64) @ layer.router_kernel.numpy())
    chosen = np.argsort(-probs, axis=1, kind="stable")[:, :2]
    f = np.bincount(chosen.ravel(), minlength=E) / chosen.size
    expected = 0.5 * E * float((f * probs.mean(axis=0)).sum())
    assert len(model.losses) == 1
    np.testing.assert_allclose(float(model.losses[0]), expected, rtol=1e-5)
    model(x, training=False)
    assert not model.losses  # inference adds no loss


def test_capacity_formula():
    assert routing.static_capacity(15, 4, 2, None) == 15
    assert routing.static_capacity(15, 4, 2, 0.5) == 4  # ceil(0.5 * 15 * 2 / 4) = ceil(3.75)
    assert routing.static_capacity(1, 2048, 1, 1.0) == 1
    assert int(routing.capacity(15, 4, 2, 0.5)) == 4


@pytest.mark.parametrize("kwargs,words", [
    (dict(num_experts=0, top_k=1, expert_hidden=4), "num_experts=0"),
    (dict(num_experts=4, top_k=5, expert_hidden=4), "top_k=5 > num_experts=4"),
    (dict(num_experts=4, top_k=1, expert_hidden=4, capacity_factor=0), "capacity_factor=0"),
    (dict(num_experts=4, top_k=1, expert_hidden=4, aux_loss_weight=-1), "aux_loss_weight"),
])
def test_bad_arguments_say_what_and_how(kwargs, words):
    with pytest.raises(ValueError, match=words):
        MixtureOfExperts(**kwargs)


def test_saves_and_loads(tmp_path):
    keras.utils.set_random_seed(4)
    inp = keras.Input((5, D))
    model = keras.Model(inp, MixtureOfExperts(E, 2, H, capacity_factor=1.25,
                                              activation="relu", name="moe")(inp))
    path = str(tmp_path / "moe.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    x = np.random.default_rng(3).normal(size=(2, 5, D)).astype("float32")
    np.testing.assert_allclose(loaded(x).numpy(), model(x).numpy(), atol=1e-6)
    layer = loaded.get_layer("moe")
    assert (layer.num_experts, layer.top_k, layer.capacity_factor) == (E, 2, 1.25)


def test_trains_with_fit():
    keras.utils.set_random_seed(5)
    inp = keras.Input((5, D))
    model = keras.Model(inp, MixtureOfExperts(E, 2, H)(inp))
    model.compile("adam", "mse")
    x = np.random.default_rng(4).normal(size=(16, 5, D)).astype("float32")
    history = model.fit(x, x, epochs=3, batch_size=8, verbose=0).history["loss"]
    assert history[-1] < history[0]
