"""The expert-parallel twin of keras_hub's ``MixtralSparseMoeBlock``: routed, 1/ep of the
experts per replica, with the block's own weights.

Pipeline position: ``apply.expert_parallel`` swaps each ``MixtralSparseMoeBlock`` inside a
replica's ``MixtralTransformerDecoder`` (or any block holding one) for
``ExpertParallelMixtralBlock`` in place (``apply.blocks.swap_in``), as it does for
``tfplan.layers.MixtureOfExperts``. apply does not import keras_hub: the block is matched
by module and class name (``MIXTRAL_BLOCK``), its load-balancing loss is the function of
its own module.

keras_hub's block computes every expert on every token (``MixtralMoeExperts``: ``[E, T,
d]``) and weights the outputs by the normalized top-k router probabilities (zero for the
experts a token did not choose). The twin routes instead (``tfplan.layers.routing``, the
same arithmetic as ``MixtureOfExperts``): softmax, top k, normalized gates (the block's
``top_p / sum(top_p)``), GShard's dispatch with no capacity limit (C = T, nothing dropped),
each expert a gated MLP ``(silu(x W_gate) * x W_up) W_down`` (``routing.expert_gated``:
the bank's ``einsum``s on its rows), and the combine. A token's output is the same sum of
the same products (the dense form adds exact zeros), so the twin computes the block's
numbers; the routed form runs ``top_k / E`` of the dense form's expert work where
``capacity`` is the routed tokens (here C = T: the buffer's shape, not its work, is E x T).

Kept from the block: the router (``_sparse_feedforward_gate_dense``, the same Dense,
replicated), the router jitter noise in training (drawn as the block draws it: random, so
not one device's), the return value ``(out, router_logits)``, and in training the aux loss
``router_aux_loss_coef * compute_load_balancing_loss(router_logits, E, top_k,
attention_mask)`` added with ``add_loss`` as the block adds it (per replica and micro-batch
under a split batch: ``apply.expert_parallel.moe_group_warning``). The expert bank
(``expert_bank``, class name ``MixtralMoeExperts``) is ``ExpertParallelMixtralExperts``:
its three stacked weights cut to ``[E/ep, ...]`` per rank, each chunk of the dispatch buffer
computed on its rank (``apply.expert_group.ExpertShards.on_ranks``). Weight files, the
class names and variable paths are the block's.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfplan.apply.expert_group import ExpertParallelError, ExpertShards
from tfplan.apply.layer_tree import scopes_of
from tfplan.apply.sharded_base import Sharded, concat_variables
from tfplan.layers import routing

MIXTRAL_BLOCK = ("keras_hub.src.models.mixtral.mixtral_decoder", "MixtralSparseMoeBlock")
MIXTRAL_EXPERTS = ("keras_hub.src.models.mixtral.mixtral_decoder", "MixtralMoeExperts")
BANK_WEIGHTS = ("expert_feedforward_gate_dense", "expert_feedforward_intermediate_dense",
                "expert_feedforward_output_dense")


def is_mixtral_block(layer: Any) -> bool:
    cls = type(layer)
    return (cls.__module__, cls.__name__) == MIXTRAL_BLOCK and \
        not isinstance(layer, ExpertParallelMixtralBlock)


class ExpertParallelMixtralExperts(ExpertShards, Sharded, keras.layers.Layer):
    """One ep rank's experts of a ``MixtralMoeExperts`` bank (module docstring)."""

    def __init__(self, bank: Any, ep: int, **kwargs: Any) -> None:
        super().__init__(name=bank.name, dtype=bank.dtype_policy, **kwargs)
        self.num_experts, self.hidden_dim = bank.num_experts, bank.hidden_dim
        self.intermediate_dim, self.activation = bank.intermediate_dim, bank.activation
        self.kernel_initializer = bank.kernel_initializer
        self.ep = ep

    def build(self, _: Any = None) -> None:
        e, d, h = self.num_experts // self.ep, self.hidden_dim, self.intermediate_dim
        self.gate, self.up, self.down = (
            self.add_weight(shape=shape, initializer=self.kernel_initializer, trainable=True,
                            name=name)
            for shape, name in zip(((e, d, h), (e, d, h), (e, h, d)), BANK_WEIGHTS))
        self.built = True

    def shard_variables(self) -> list[Any]:
        return [self.gate, self.up, self.down]

    def experts(self, xe: tf.Tensor) -> tf.Tensor:
        """Every expert on its rows of ``xe`` ([E, C, d]), chunk j on rank j."""
        def gated(peer: Any, chunk: tf.Tensor) -> tf.Tensor:
            return routing.expert_gated(chunk, peer.gate, peer.up, peer.down, self.activation)
        return self.on_ranks(xe, gated)

    def full_pieces(self) -> list[tuple[tuple[Any, ...], int | None]]:
        return self.stacked_pieces()

    def full_weights(self) -> list[np.ndarray]:
        self.check_linked()
        return [concat_variables(shards, 0) for shards, _ in self.full_pieces()]

    def set_full_weights(self, weights: Sequence[Any]) -> None:
        self.assign_stacked(weights)


class ExpertParallelMixtralBlock(keras.layers.Layer):
    """``MixtralSparseMoeBlock`` routed over an expert-parallel bank (module docstring)."""

    is_expert_twin = True

    def __init__(self, block: Any, bank: ExpertParallelMixtralExperts,
                 aux_loss: Any) -> None:
        super().__init__(name=block.name, dtype=block.dtype_policy)
        for attr in ("hidden_dim", "intermediate_dim", "num_experts", "top_k",
                     "router_jitter_noise", "layer_norm_epsilon", "router_aux_loss_coef"):
            setattr(self, attr, getattr(block, attr))
        self._sparse_feedforward_gate_dense = block._sparse_feedforward_gate_dense  # router
        self.expert_bank = bank
        self._aux = _Function(aux_loss)
        self.built = True

    def call(self, hidden_states: Any, attention_mask: Any = None, training: Any = False
             ) -> tuple[Any, Any]:
        shape = tf.shape(hidden_states)
        flat = tf.reshape(hidden_states, (-1, self.hidden_dim))
        if training and self.router_jitter_noise > 0:  # as the block draws it
            flat = flat * keras.random.uniform(
                tf.shape(flat), minval=1.0 - self.router_jitter_noise,
                maxval=1.0 + self.router_jitter_noise, dtype=flat.dtype)
        router_logits = self._sparse_feedforward_gate_dense(flat)
        decision = routing.route(router_logits, self.top_k, normalize=True)
        cap = routing.capacity(tf.shape(flat)[0], self.num_experts, self.top_k, None)
        slot = routing.slots(decision.experts, self.num_experts, cap)
        xe = routing.dispatch(flat, slot, self.num_experts, cap)
        out = routing.combine(self.expert_bank.experts(xe), slot, decision.gates)
        if training:
            self.add_loss(self.router_aux_loss_coef * self._aux.fn(
                router_logits=router_logits, num_experts=self.num_experts,
                top_k=self.top_k, attention_mask=attention_mask))
        return tf.reshape(out, shape), router_logits


class _Function:
    """A function held out of Keras' sight (its weight files walk a layer's attributes)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn


ExpertParallelMixtralExperts.__module__, ExpertParallelMixtralExperts.__name__ = MIXTRAL_EXPERTS
ExpertParallelMixtralBlock.__module__, ExpertParallelMixtralBlock.__name__ = MIXTRAL_BLOCK


def mixtral_twin(block: Any, original: Any, ep: int, rank: int, device: str
                 ) -> ExpertParallelMixtralBlock:
    """The twin of a built ``MixtralSparseMoeBlock`` (its router reused, its bank's experts
    of ``rank`` copied into a shard built on ``device``). ``original``: the user's block,
    whose ``router_aux_loss_coef`` the twin keeps (keras_hub's MixtralTransformerDecoder
    leaves it out of its config, so a block re-created from it has the default 0.02)."""
    bank = block.expert_bank
    if (type(bank).__module__, type(bank).__name__) != MIXTRAL_EXPERTS or \
            [v.name for v in bank.weights] != list(BANK_WEIGHTS):
        raise ExpertParallelError(
            f"Mixtral block {block.name!r} holds an expert bank of class "
            f"{type(bank).__name__} with weights {[v.name for v in bank.weights]}; apply "
            f"splits keras_hub's MixtralMoeExperts (expected weights {list(BANK_WEIGHTS)}). "
            "Re-plan with ep=1.")
    aux = getattr(sys.modules.get(type(block).__module__), "compute_load_balancing_loss", None)
    if aux is None:
        raise ExpertParallelError(
            f"Mixtral block {block.name!r}: its module {type(block).__module__} has no "
            "compute_load_balancing_loss (received a keras_hub apply was not written for, "
            "expected the one of keras_hub 0.2x). Re-plan with ep=1.")
    shard = ExpertParallelMixtralExperts(bank, ep)
    shard.init_ep(ep, rank, device)
    with tf.device(device), scopes_of(bank):  # variable paths as the bank's
        shard.build()
    shard.set_full_weights(bank.get_weights())  # this rank's slice (not linked yet)
    with tf.device(device):
        twin = ExpertParallelMixtralBlock(block, shard, aux)
    twin.router_aux_loss_coef = original.router_aux_loss_coef
    return twin
