"""Top-k routing, dispatch and combine for mixture-of-experts layers: pure TensorFlow.

Pipeline position: the arithmetic ``tfplan.layers.MixtureOfExperts`` runs, and that
``apply``'s expert-parallel twin runs on each device's share of the experts; one copy,
so the two compute the same numbers in the same order.

The dispatch is GShard's (Lepikhin et al., 2020, Alg. 1) and Switch Transformer's
(Fedus et al., 2021, Sec. 2.1): each token's ``top_k`` experts are taken from the
router's softmax; each (token, choice) gets a slot ``e * C + position`` in a buffer of
``num_experts x C`` rows, position counted in priority order (every token's first
choice before any second choice, tokens in order); a choice whose position reaches the
capacity ``C`` is dropped (its row stays out, its gate counts zero: the residual
connection around the layer carries the token). The buffer ``[E, C, d]`` goes through
the experts as batched einsums and comes back by gathering each choice's row, weighted
by its gate.

Capacity (``capacity``): ``C = ceil(capacity_factor * T * top_k / E)`` for ``T`` tokens
(Switch Transformer, eq. 3); with no capacity factor, ``C = T``: an expert receives a
token at most once, so nothing is ever dropped (the buffer then holds ``E * T`` rows,
``E / top_k`` times the routed work: set a capacity factor for speed).

Symbols: T tokens in the call (batch x sequence), d model width, E experts, k top_k,
C capacity per expert, h an expert's hidden width.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import tensorflow as tf


class Routing(NamedTuple):
    """The router's decision for T tokens."""

    probs: tf.Tensor  # [T, E] softmax of the logits (float32)
    gates: tf.Tensor  # [T, k] weight of each chosen expert (the logits' dtype)
    experts: tf.Tensor  # [T, k] int32 chosen expert, best first


def route(logits: tf.Tensor, top_k: int, normalize: bool) -> Routing:
    """Softmax over the experts (in float32), the ``top_k`` best, and their gates: the
    probabilities themselves, or (``normalize``) divided by their sum over the k chosen
    (Mixtral's and Qwen-MoE's ``norm_top_k_prob``)."""
    probs = tf.nn.softmax(tf.cast(logits, tf.float32), axis=-1)
    top_p, top_i = tf.math.top_k(probs, k=top_k)
    if normalize:
        top_p = top_p / tf.reduce_sum(top_p, axis=-1, keepdims=True)
    return Routing(probs, tf.cast(top_p, logits.dtype), tf.cast(top_i, tf.int32))


def capacity(tokens: tf.Tensor | int, num_experts: int, top_k: int,
             capacity_factor: float | None) -> tf.Tensor:
    """Rows per expert in the dispatch buffer (module docstring): ``T`` with no capacity
    factor, else ``max(1, ceil(capacity_factor * T * k / E))``."""
    tokens = tf.cast(tokens, tf.int32)
    if capacity_factor is None:
        return tokens
    c = tf.math.ceil(tf.cast(tokens, tf.float64) * (capacity_factor * top_k / num_experts))
    return tf.maximum(tf.cast(c, tf.int32), 1)


def static_capacity(tokens: int, num_experts: int, top_k: int,
                    capacity_factor: float | None) -> int:
    """``capacity`` for a known token count, as a Python int (what the profiler prices)."""
    if capacity_factor is None:
        return tokens
    return max(1, math.ceil(tokens * capacity_factor * top_k / num_experts))


def slots(experts: tf.Tensor, num_experts: int, cap: tf.Tensor) -> tf.Tensor:
    """[T, k] int32: each choice's row ``e * C + position`` in the ``E * C`` buffer, or
    ``E * C`` (one spare row, discarded) when its position reaches the capacity."""
    k = tf.shape(experts)[1]
    by_choice = tf.reshape(tf.transpose(experts), [-1])  # choice-major priority order
    onehot = tf.one_hot(by_choice, num_experts, dtype=tf.int32)  # [k T, E]
    before = tf.cumsum(onehot, axis=0, exclusive=True)
    position = tf.reduce_sum(before * onehot, axis=1)
    row = tf.where(position < cap, by_choice * cap + position, num_experts * cap)
    return tf.transpose(tf.reshape(row, [k, -1]))


def dispatch(x: tf.Tensor, slot: tf.Tensor, num_experts: int, cap: tf.Tensor) -> tf.Tensor:
    """[E, C, d]: every kept choice's token in its row, zeros elsewhere (``x`` is [T, d])."""
    k = tf.shape(slot)[1]
    d = tf.shape(x)[-1]
    rows = tf.reshape(tf.repeat(x[:, None, :], k, axis=1), [-1, d])  # [T k, d]
    buffer = tf.scatter_nd(tf.reshape(slot, [-1, 1]), rows,
                           tf.stack([num_experts * cap + 1, d]))
    return tf.reshape(buffer[:num_experts * cap], tf.stack([num_experts, cap, d]))


def combine(y: tf.Tensor, slot: tf.Tensor, gates: tf.Tensor) -> tf.Tensor:
    """[T, d]: each token's chosen experts' rows of ``y`` ([E, C, d]) weighted by their
    gates and summed in choice order (a dropped choice adds zero)."""
    d = tf.shape(y)[-1]
    flat = tf.concat([tf.reshape(y, tf.stack([-1, d])), tf.zeros(tf.stack([1, d]), y.dtype)], 0)
    rows = tf.gather(flat, slot)  # [T, k, d]
    return tf.reduce_sum(rows * tf.cast(gates, y.dtype)[..., None], axis=1)


def expert_mlp(xe: tf.Tensor, w_in: tf.Tensor, b_in: tf.Tensor | None, w_out: tf.Tensor,
               b_out: tf.Tensor | None, activation) -> tf.Tensor:
    """Each expert's two-layer MLP on its rows: ``act(x W_in + b_in) W_out + b_out``;
    ``xe`` [E, C, d], ``w_in`` [E, d, h], ``w_out`` [E, h, d]."""
    h = tf.einsum("ecd,edh->ech", xe, w_in)
    if b_in is not None:
        h = h + b_in[:, None, :]
    y = tf.einsum("ech,ehd->ecd", activation(h), w_out)
    return y + b_out[:, None, :] if b_out is not None else y


def expert_gated(xe: tf.Tensor, w_gate: tf.Tensor, w_up: tf.Tensor, w_down: tf.Tensor,
                 activation) -> tf.Tensor:
    """Each expert's gated MLP (SwiGLU with SiLU; Mixtral, Qwen-MoE):
    ``(act(x W_gate) * x W_up) W_down``."""
    gate = activation(tf.einsum("ecd,edh->ech", xe, w_gate))
    up = tf.einsum("ecd,edh->ech", xe, w_up)
    return tf.einsum("ech,ehd->ecd", gate * up, w_down)


def load_balancing_loss(routing: Routing, num_experts: int) -> tf.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al., 2021, eq. 4) over the k choices:
    ``E * sum_e f_e P_e``, f_e the share of choices sent to expert e, P_e its mean
    router probability. A mean over this call's tokens: computed per replica and
    micro-batch when the batch is split (GShard's groups)."""
    counts = tf.reduce_sum(tf.one_hot(routing.experts, num_experts, dtype=tf.float32), [0, 1])
    f = counts / tf.reduce_sum(counts)
    p = tf.reduce_mean(routing.probs, axis=0)
    return num_experts * tf.reduce_sum(f * p)
