"""The expert-parallel twin of keras_hub's ``MixtralSparseMoeBlock``: routed, 1/ep of the
experts per replica, with the block's own weights.

Pipeline position: ``apply.expert_parallel`` swaps each ``MixtralSparseMoeBlock`` inside a
replica's ``MixtralTransformerDecoder`` (or any block holding one) for
``ExpertParallelMixtralBlock`` in place (``apply.blocks.swap_in``), as it does for
``tfplan.layers.MixtureOfExperts``. apply does not import keras_hub: the block is matched
by module and class name (``MIXTRAL_BLOCK``), its load-balancing loss is the function of
its own module. What this twin shares with Qwen-MoE's (``apply.expert_parallel_qwen``):
``apply.expert_parallel_hub``.

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

from typing import Any

import keras
import tensorflow as tf

from tfplan.apply.expert_parallel_hub import (HubExpertShard, HubMoeTwin, hub_twin,
                                             is_hub_class)
from tfplan.layers import routing

MIXTRAL_BLOCK = ("keras_hub.src.models.mixtral.mixtral_decoder", "MixtralSparseMoeBlock")
MIXTRAL_EXPERTS = ("keras_hub.src.models.mixtral.mixtral_decoder", "MixtralMoeExperts")


def is_mixtral_block(layer: Any) -> bool:
    return is_hub_class(layer, MIXTRAL_BLOCK)


class ExpertParallelMixtralExperts(HubExpertShard):
    """One ep rank's experts of a ``MixtralMoeExperts`` bank (module docstring)."""

    weight_names = ("expert_feedforward_gate_dense", "expert_feedforward_intermediate_dense",
                    "expert_feedforward_output_dense")

    def unsplit_shapes(self) -> tuple[tuple[int, ...], ...]:
        e, d, h = self.num_experts, self.hidden_dim, self.intermediate_dim
        return (e, d, h), (e, d, h), (e, h, d)

    def chunk_experts(self, peer: Any, chunk: tf.Tensor) -> tf.Tensor:
        return routing.expert_gated(chunk, *peer.shard_variables(), self.activation)


class ExpertParallelMixtralBlock(HubMoeTwin):
    """``MixtralSparseMoeBlock`` routed over an expert-parallel bank (module docstring)."""

    kept = ("hidden_dim", "intermediate_dim", "num_experts", "top_k", "router_jitter_noise",
            "layer_norm_epsilon", "router_aux_loss_coef")

    def call(self, hidden_states: Any, attention_mask: Any = None, training: Any = False
             ) -> tuple[Any, Any]:
        shape = tf.shape(hidden_states)
        flat = tf.reshape(hidden_states, (-1, self.hidden_dim))
        if training and self.router_jitter_noise > 0:  # as the block draws it
            flat = flat * keras.random.uniform(
                tf.shape(flat), minval=1.0 - self.router_jitter_noise,
                maxval=1.0 + self.router_jitter_noise, dtype=flat.dtype)
        out, router_logits = self.routed(flat, normalize=True)
        if training:
            self.add_loss(self.router_aux_loss_coef * self.aux_loss(router_logits,
                                                                    attention_mask))
        return tf.reshape(out, shape), router_logits


ExpertParallelMixtralExperts.__module__, ExpertParallelMixtralExperts.__name__ = MIXTRAL_EXPERTS
ExpertParallelMixtralBlock.__module__, ExpertParallelMixtralBlock.__name__ = MIXTRAL_BLOCK


def mixtral_twin(block: Any, original: Any, ep: int, rank: int, device: str
                 ) -> ExpertParallelMixtralBlock:
    """The twin of a built ``MixtralSparseMoeBlock`` (its router reused, its bank's experts
    of ``rank`` copied into a shard built on ``device``). ``original``: the user's block,
    whose ``router_aux_loss_coef`` the twin keeps (keras_hub's MixtralTransformerDecoder
    leaves it out of its config, so a block re-created from it has the default 0.02)."""
    twin = hub_twin(block, ep, rank, device, bank_class=MIXTRAL_EXPERTS,
                    shard_class=ExpertParallelMixtralExperts,
                    twin_class=ExpertParallelMixtralBlock)
    twin.router_aux_loss_coef = original.router_aux_loss_coef
    return twin
