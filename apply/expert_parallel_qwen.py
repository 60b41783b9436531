"""The expert-parallel twin of keras_hub's ``QwenSparseMoeBlock`` (Qwen-MoE, Qwen1.5/2):
routed, 1/ep of the experts per replica, with the block's own weights and its shared
expert replicated.

Pipeline position: ``apply.expert_parallel`` swaps each ``QwenSparseMoeBlock`` inside a
replica's ``QwenMoeTransformerDecoder`` (or any block holding one) for
``ExpertParallelQwenBlock`` in place (``apply.blocks.swap_in``), as it does for Mixtral's
block (``apply.expert_parallel_mixtral``); what the two twins share (the routed forward,
the bank's shard, building a twin) is ``apply.expert_parallel_hub``. apply does not import
keras_hub: the block is matched by module and class name (``QWEN_BLOCK``), its
load-balancing loss is the function of its own module.

keras_hub's block computes every expert on every token (``QwenMoeExperts``: ``[E, T, d]``)
and weights the outputs by the top-k router probabilities (divided by their sum when
``norm_top_k_prob``; zero for the experts a token did not choose), then adds the shared
expert ``shared_expert_dense(x) * sigmoid(shared_expert_gate_dense(x))``. The twin routes
the experts instead (``tfplan.layers.routing``): softmax, top k, the gates normalized as
``norm_top_k_prob`` says, GShard's dispatch with no capacity limit (C = T, nothing
dropped), each expert a gated MLP ``(silu(x W_gate) * x W_up) W_down`` and the combine.
The bank's gate and up projections are one fused ``[E, d, 2h]`` kernel
(``expert_feedforward_gate_dense``; the first h columns the gate, the last h the up
projection, as the bank's ``split``) and ``[E, h, d]`` the output; the twin's shard holds
``[E/ep, d, 2h]`` and ``[E/ep, h, d]`` of them. A token's output is the same sum of the
same products (the dense form adds exact zeros), so the twin computes the block's numbers.

Kept from the block: the router (``_sparse_feedforward_gate_dense``, the same Dense,
replicated), the shared expert (``shared_expert_dense``, a ``QwenMoeMLP``) and its gate
(``shared_expert_gate_dense``), both the replica's own layers, replicated and computed on
the replica's device as the block computes them; the return value ``(out,
router_logits)``; and in training the aux loss ``router_aux_loss_coefficient *
compute_load_balancing_loss(router_logits, E, top_k, attention_mask)`` added with
``add_loss`` as the block adds it (per replica and micro-batch under a split batch:
``apply.expert_parallel.moe_group_warning``). The expert bank (``expert_bank``, class name
``QwenMoeExperts``) is ``ExpertParallelQwenExperts``, each chunk of the dispatch buffer
computed on its rank (``apply.expert_group.ExpertShards.on_ranks``). Weight files, the
class names and variable paths are the block's.
"""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfplan.apply.expert_parallel_hub import (HubExpertShard, HubMoeTwin, hub_twin,
                                             is_hub_class)
from tfplan.layers import routing

QWEN_BLOCK = ("keras_hub.src.models.qwen_moe.qwen_moe_decoder", "QwenSparseMoeBlock")
QWEN_EXPERTS = ("keras_hub.src.models.qwen_moe.qwen_moe_decoder", "QwenMoeExperts")


def is_qwen_moe_block(layer: Any) -> bool:
    return is_hub_class(layer, QWEN_BLOCK)


class ExpertParallelQwenExperts(HubExpertShard):
    """One ep rank's experts of a ``QwenMoeExperts`` bank (module docstring)."""

    weight_names = ("expert_feedforward_gate_dense", "expert_feedforward_output_dense")

    def unsplit_shapes(self) -> tuple[tuple[int, ...], ...]:
        e, d, h = self.num_experts, self.hidden_dim, self.intermediate_dim
        return (e, d, 2 * h), (e, h, d)

    def chunk_experts(self, peer: Any, chunk: tf.Tensor) -> tf.Tensor:
        gate_up, down = peer.shard_variables()
        h = self.intermediate_dim  # gate: the first h columns, up: the last h (the bank's)
        return routing.expert_gated(chunk, gate_up[..., :h], gate_up[..., h:], down,
                                    self.activation)


class ExpertParallelQwenBlock(HubMoeTwin):
    """``QwenSparseMoeBlock`` routed over an expert-parallel bank, its shared expert
    replicated (module docstring)."""

    kept = ("hidden_dim", "intermediate_dim", "intermediate_dim_shared", "num_experts",
            "top_k", "norm_top_k_prob", "kernel_initializer", "layer_norm_epsilon",
            "router_aux_loss_coefficient")

    def __init__(self, block: Any, bank: ExpertParallelQwenExperts, aux_loss: Any) -> None:
        super().__init__(block, bank, aux_loss)
        self.shared_expert_dense = block.shared_expert_dense
        self.shared_expert_gate_dense = block.shared_expert_gate_dense

    def call(self, hidden_states: Any, attention_mask: Any = None, training: Any = None
             ) -> tuple[Any, Any]:
        shape = tf.shape(hidden_states)
        flat = tf.reshape(hidden_states, (-1, self.hidden_dim))
        experts, router_logits = self.routed(flat, normalize=bool(self.norm_top_k_prob))
        shared = self.shared_expert_dense(flat)  # on this replica's device, as the block
        shared *= tf.sigmoid(self.shared_expert_gate_dense(flat))
        out = tf.reshape(experts + shared, shape)
        if training:
            self.add_loss(self.router_aux_loss_coefficient * self.aux_loss(router_logits,
                                                                           attention_mask))
        return out, router_logits


ExpertParallelQwenExperts.__module__, ExpertParallelQwenExperts.__name__ = QWEN_EXPERTS
ExpertParallelQwenBlock.__module__, ExpertParallelQwenBlock.__name__ = QWEN_BLOCK


def qwen_moe_twin(block: Any, original: Any, ep: int, rank: int, device: str
                  ) -> ExpertParallelQwenBlock:
    """The twin of a built ``QwenSparseMoeBlock`` (its router, shared expert and shared
    gate reused, its bank's experts of ``rank`` copied into a shard built on ``device``).
    ``original``: the user's block, whose ``router_aux_loss_coefficient`` the twin keeps
    (whatever the re-created block's configuration carried)."""
    twin = hub_twin(block, ep, rank, device, bank_class=QWEN_EXPERTS,
                    shard_class=ExpertParallelQwenExperts, twin_class=ExpertParallelQwenBlock)
    twin.router_aux_loss_coefficient = original.router_aux_loss_coefficient
    return twin
