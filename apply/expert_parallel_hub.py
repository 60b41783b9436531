"""What the expert-parallel twins of keras_hub's MoE blocks share: the routed forward over
an expert bank cut 1/ep per replica, and building such a twin from a replica's block.

Pipeline position: under ``apply.expert_parallel_mixtral`` (Mixtral's
``MixtralSparseMoeBlock``) and ``apply.expert_parallel_qwen`` (Qwen-MoE's
``QwenSparseMoeBlock``), which ``apply.expert_parallel`` swaps into each replica's decoder
blocks. apply does not import keras_hub: banks are matched by module and class name, and
a block's load-balancing loss is the ``compute_load_balancing_loss`` of its own module.

``HubExpertShard`` holds one ep rank's slices ``[E/ep, ...]`` of a bank's stacked weights
(names as the bank's, so weight files and variable paths are the bank's) and runs chunk j
of a dispatch buffer on rank j (``apply.expert_group.ExpertShards.on_ranks``).
``HubMoeTwin.routed`` is both blocks' expert part computed routed instead of densely
(``tfplan.layers.routing``: softmax, top k, the gates normalized or not, GShard's dispatch
with no capacity limit so nothing is dropped, the bank's experts on their rows, the
combine): a token's output is the same sum of the same products as the block's dense
form, which only adds exact zeros.
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


def is_hub_class(layer: Any, name: tuple[str, str]) -> bool:
    """Whether ``layer``'s class is keras_hub's ``name`` (module, class), not a twin."""
    cls = type(layer)
    return (cls.__module__, cls.__name__) == name and not getattr(layer, "is_expert_twin",
                                                                  False)


class HubExpertShard(ExpertShards, Sharded, keras.layers.Layer):
    """One ep rank's experts of a keras_hub expert bank; a subclass names the bank's stacked
    weights (``weight_names``), their unsplit shapes (``unsplit_shapes``) and one rank's
    experts on its chunk (``chunk_experts``)."""

    weight_names: tuple[str, ...] = ()

    def __init__(self, bank: Any, ep: int, **kwargs: Any) -> None:
        super().__init__(name=bank.name, dtype=bank.dtype_policy, **kwargs)
        self.num_experts, self.hidden_dim = bank.num_experts, bank.hidden_dim
        self.intermediate_dim, self.activation = bank.intermediate_dim, bank.activation
        self.kernel_initializer = bank.kernel_initializer
        self.ep = ep

    def unsplit_shapes(self) -> tuple[tuple[int, ...], ...]:
        raise NotImplementedError

    def chunk_experts(self, peer: Any, chunk: tf.Tensor) -> tf.Tensor:
        """``peer``'s experts on their rows ``chunk`` ([E/ep, C, d]), on peer's device."""
        raise NotImplementedError

    def build(self, _: Any = None) -> None:
        for name, shape in zip(self.weight_names, self.unsplit_shapes(), strict=True):
            self.add_weight(shape=(shape[0] // self.ep, *shape[1:]), trainable=True,
                            initializer=self.kernel_initializer, name=name)
        self.built = True

    def shard_variables(self) -> list[Any]:
        return list(self.weights)  # the stacked weights, the bank's order

    def experts(self, xe: tf.Tensor) -> tf.Tensor:
        """Every expert on its rows of ``xe`` ([E, C, d]), chunk j on rank j."""
        return self.on_ranks(xe, self.chunk_experts)

    def full_pieces(self) -> list[tuple[tuple[Any, ...], int | None]]:
        return self.stacked_pieces()

    def full_weights(self) -> list[np.ndarray]:
        self.check_linked()
        return [concat_variables(shards, 0) for shards, _ in self.full_pieces()]

    def set_full_weights(self, weights: Sequence[Any]) -> None:
        self.assign_stacked(weights)


class HeldFunction:
    """A function held out of Keras' sight (its weight files walk a layer's attributes)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn


class HubMoeTwin(keras.layers.Layer):
    """A keras_hub MoE block's twin: the block's router (the same Dense, replicated), its
    attributes ``kept``, the bank's shard as ``expert_bank``, the block's aux-loss function;
    a subclass writes ``call`` around ``routed``."""

    is_expert_twin = True
    kept: tuple[str, ...] = ()

    def __init__(self, block: Any, bank: HubExpertShard, aux_loss: Any) -> None:
        super().__init__(name=block.name, dtype=block.dtype_policy)
        for attr in self.kept:
            setattr(self, attr, getattr(block, attr))
        self._sparse_feedforward_gate_dense = block._sparse_feedforward_gate_dense  # router
        self.expert_bank = bank
        self._aux = HeldFunction(aux_loss)
        self.built = True

    def routed(self, flat: tf.Tensor, normalize: bool) -> tuple[tf.Tensor, tf.Tensor]:
        """(the experts' gated sum ``[T, d]``, the router logits ``[T, E]``) for ``flat``."""
        router_logits = self._sparse_feedforward_gate_dense(flat)
        decision = routing.route(router_logits, self.top_k, normalize=normalize)
        cap = routing.capacity(tf.shape(flat)[0], self.num_experts, self.top_k, None)
        slot = routing.slots(decision.experts, self.num_experts, cap)
        xe = routing.dispatch(flat, slot, self.num_experts, cap)
        out = routing.combine(self.expert_bank.experts(xe), slot, decision.gates)
        return out, router_logits

    def aux_loss(self, router_logits: tf.Tensor, attention_mask: Any) -> tf.Tensor:
        """The block's own ``compute_load_balancing_loss`` (without its coefficient)."""
        return self._aux.fn(router_logits=router_logits, num_experts=self.num_experts,
                            top_k=self.top_k, attention_mask=attention_mask)


def hub_twin(block: Any, ep: int, rank: int, device: str, *, bank_class: tuple[str, str],
             shard_class: type[HubExpertShard], twin_class: type[HubMoeTwin]) -> Any:
    """``twin_class`` of a built keras_hub block (its router and other sub-layers reused,
    its bank's experts of ``rank`` copied into a ``shard_class`` built on ``device``)."""
    bank, kind = block.expert_bank, type(block).__name__
    names = list(shard_class.weight_names)
    if (type(bank).__module__, type(bank).__name__) != bank_class or \
            [v.name for v in bank.weights] != names:
        raise ExpertParallelError(
            f"{kind} {block.name!r} holds an expert bank of class {type(bank).__name__} "
            f"with weights {[v.name for v in bank.weights]}; apply splits keras_hub's "
            f"{bank_class[1]} (expected weights {names}). Re-plan with ep=1.")
    aux = getattr(sys.modules.get(type(block).__module__), "compute_load_balancing_loss", None)
    if aux is None:
        raise ExpertParallelError(
            f"{kind} {block.name!r}: its module {type(block).__module__} has no "
            "compute_load_balancing_loss (received a keras_hub apply was not written for, "
            "expected the one of keras_hub 0.3x). Re-plan with ep=1.")
    shard = shard_class(bank, ep)
    shard.init_ep(ep, rank, device)
    with tf.device(device), scopes_of(bank):  # variable paths as the bank's
        shard.build()
    shard.set_full_weights(bank.get_weights())  # this rank's slice (not linked yet)
    with tf.device(device):
        return twin_class(block, shard, aux)
