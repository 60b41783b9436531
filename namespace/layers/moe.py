"""``MixtureOfExperts``: a routed mixture-of-experts feed-forward layer (Keras 3, TF).

Pipeline position: a layer users put in their models (``tfplan.layers``). The
profiler counts it by its routed work (``profiler.moe``), the planner may spread its
experts over devices (expert parallelism, ``Strategy.ep``), and ``apply`` swaps it for
its expert-parallel twin holding each device's experts. The arithmetic is
``tfplan.layers.routing``'s (GShard's dispatch and combine), shared with that twin.

Per token x (width d): the router ``x W_r`` ([d, E], no bias) gives E logits; the
``top_k`` experts with the highest softmax probabilities take the token, each expert
``e`` a two-layer MLP ``act(x W_in[e] + b_in[e]) W_out[e] + b_out[e]`` (``W_in`` [E, d,
h], ``W_out`` [E, h, d]); the output is the gate-weighted sum of the chosen experts'
outputs. Gates are the probabilities (Switch Transformer, top_k = 1) or, with
``normalize_top_k`` (the default when top_k > 1, as Mixtral), the probabilities divided
by their sum over the chosen experts.

``capacity_factor``: None (default) drops no token; a number caps each expert at
``ceil(capacity_factor * T * top_k / E)`` tokens per call (Switch Transformer, eq. 3),
T the call's tokens -- a replica's micro-batch when the batch is split, so with a
capacity factor, what is dropped depends on the plan (GShard's groups).

``aux_loss_weight``: weight of Switch Transformer's load-balancing loss, added with
``add_loss`` when training; computed over the call's tokens, so per replica and
micro-batch under a split batch (not equal to one device unless it is 0).
"""
from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tfplan.layers import routing


@keras.saving.register_keras_serializable(package="tfplan")
class MixtureOfExperts(keras.layers.Layer):
    """A routed mixture of ``num_experts`` MLP experts, ``top_k`` per token (module
    docstring). Input and output ``[..., d]``."""

    def __init__(self, num_experts: int, top_k: int, expert_hidden: int,
                 capacity_factor: float | None = None, activation: Any = "gelu",
                 use_bias: bool = True, normalize_top_k: bool | None = None,
                 aux_loss_weight: float = 0.01, kernel_initializer: Any = "glorot_uniform",
                 bias_initializer: Any = "zeros", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for name, value in (("num_experts", num_experts), ("top_k", top_k),
                            ("expert_hidden", expert_hidden)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MixtureOfExperts {name}={value!r}: expected a positive "
                                 "integer.")
        if top_k > num_experts:
            raise ValueError(f"MixtureOfExperts top_k={top_k} > num_experts={num_experts}: "
                             "a token cannot choose more experts than there are; lower top_k.")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"MixtureOfExperts capacity_factor={capacity_factor!r}: expected "
                             "a number > 0, or None for no capacity limit (no token dropped).")
        if aux_loss_weight < 0:
            raise ValueError(f"MixtureOfExperts aux_loss_weight={aux_loss_weight!r}: expected "
                             ">= 0 (0 turns the load-balancing loss off).")
        self.num_experts = num_experts
        self.top_k = top_k
        self.expert_hidden = expert_hidden
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.activation = keras.activations.get(activation)
        self.use_bias = use_bias
        self.normalize_top_k = top_k > 1 if normalize_top_k is None else bool(normalize_top_k)
        self.aux_loss_weight = float(aux_loss_weight)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def build(self, input_shape: Any) -> None:
        d = input_shape[-1]
        if d is None:
            raise ValueError("MixtureOfExperts: the input's last dimension (the model width) "
                             f"must be known; received shape {tuple(input_shape)}.")
        e, h = self.local_experts(), self.expert_hidden
        self.router_kernel = self.add_weight(shape=(d, self.num_experts), name="router_kernel",
                                             initializer=self.kernel_initializer)
        self.expert_in_kernel = self.add_weight(shape=(e, d, h), name="expert_in_kernel",
                                                initializer=self.kernel_initializer)
        self.expert_in_bias = (self.add_weight(shape=(e, h), name="expert_in_bias",
                                               initializer=self.bias_initializer)
                               if self.use_bias else None)
        self.expert_out_kernel = self.add_weight(shape=(e, h, d), name="expert_out_kernel",
                                                 initializer=self.kernel_initializer)
        self.expert_out_bias = (self.add_weight(shape=(e, d), name="expert_out_bias",
                                                initializer=self.bias_initializer)
                                if self.use_bias else None)

    def local_experts(self) -> int:
        """How many experts this layer object holds weights for (all of them; an
        expert-parallel twin in ``apply`` holds its rank's share)."""
        return self.num_experts

    def expert_weights(self) -> tuple[Any, ...]:
        """The stacked expert weights, ``[E, ...]`` each, in ``expert_mlp``'s order (biases
        None without ``use_bias``): what expert parallelism divides."""
        return (self.expert_in_kernel, self.expert_in_bias, self.expert_out_kernel,
                self.expert_out_bias)

    def route(self, flat: tf.Tensor) -> routing.Routing:
        """The router's decision for ``flat`` ([T, d])."""
        return routing.route(tf.matmul(flat, self.router_kernel), self.top_k,
                             self.normalize_top_k)

    def experts(self, xe: tf.Tensor, weights: tuple[Any, ...] | None = None) -> tf.Tensor:
        """The experts on their dispatch rows ``xe`` ([E', C, d]) with ``weights`` (the
        stacked weights of those E' experts; all of this layer's by default)."""
        w_in, b_in, w_out, b_out = weights if weights is not None else self.expert_weights()
        return routing.expert_mlp(xe, w_in, b_in, w_out, b_out, self.activation)

    def call(self, inputs: tf.Tensor, training: bool | None = None) -> tf.Tensor:
        d = tf.shape(inputs)[-1]
        flat = tf.reshape(inputs, tf.stack([-1, d]))
        decision = self.route(flat)
        cap = routing.capacity(tf.shape(flat)[0], self.num_experts, self.top_k,
                               self.capacity_factor)
        slot = routing.slots(decision.experts, self.num_experts, cap)
        xe = routing.dispatch(flat, slot, self.num_experts, cap)
        out = routing.combine(self.experts(xe), slot, decision.gates)
        if training and self.aux_loss_weight:
            self.add_loss(self.aux_loss_weight
                          * routing.load_balancing_loss(decision, self.num_experts))
        return tf.reshape(out, tf.shape(inputs))

    def compute_output_shape(self, input_shape: Any) -> Any:
        return tuple(input_shape)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            num_experts=self.num_experts, top_k=self.top_k, expert_hidden=self.expert_hidden,
            capacity_factor=self.capacity_factor,
            activation=keras.activations.serialize(self.activation), use_bias=self.use_bias,
            normalize_top_k=self.normalize_top_k, aux_loss_weight=self.aux_loss_weight,
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
            bias_initializer=keras.initializers.serialize(self.bias_initializer))
        return config
