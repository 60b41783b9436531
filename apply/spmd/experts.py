"""Expert parallelism on the SPMD engine: each replica holds 1/ep of every
mixture-of-experts layer's experts; tokens meet their experts in two all-to-alls.

Pipeline position: ``apply.spmd.copies`` swaps every ``tfplan.layers.MixtureOfExperts`` of a
copy (top-level, or inside a block) for its expert twin (``apply.expert_parallel``'s
``ExpertParallelMoE``: the layer's own routing, ``tfplan.layers.routing``, on E/ep
experts), and every keras_hub Mixtral or Qwen-MoE block inside its decoder block for the
routed twin ``apply.expert_parallel_mixtral`` / ``_qwen`` make (its bank cut to E/ep
experts), and gives the expert shard ``exchange``, which replaces the twin's placed transfers with
collectives over the plan's ``ep`` group (``apply.groups``). ``SpmdModel`` sums an expert
shard's gradient over its ``edp`` group (the replicas with the same experts) instead of the
``dp`` group, and ``Copies`` reads and writes the unsplit ``[E, ...]`` weights from the ep
ranks' slices (``ep_cut``).

Layout (``planner.plan.Strategy.ep``, GShard, Lepikhin et al. 2020, Sec. 3.2; DeepSpeed-MoE):
data-parallel rank r has ep rank k = r % ep in ep group r // ep and holds experts
k E/ep .. (k+1) E/ep - 1 of every MoE layer; its router and every other layer are
replicated. A MoE layer is not split by tensor parallelism: each tensor rank routes its
replica's tokens through the ep group of its own tensor rank.

The step of rank k, per MoE layer and micro-batch (C: the capacity, rows per expert of the
dispatch buffer, ``routing.capacity``: T tokens without a capacity factor):

1. route and dispatch its tokens into ``xe`` [E, C, d] (as one device does);
2. all-to-all over the ep group: slice j of ``xe`` (experts of rank j) to rank j; rank k
   receives every rank's rows for its own experts, [ep, E/ep, C, d], and runs its
   experts on them as [E/ep, ep C, d];
3. all-to-all back: each rank gets its rows' outputs in expert order, [E, C, d], and
   combines them with its gates.

The backward of an all-to-all is the all-to-all of the gradients (the exchange is its own
inverse's transpose), so each pass runs two all-to-alls of E C d values per layer and
micro-batch, of which (ep-1)/ep leave the rank: what ``planner.traffic`` prices as ``ep``
(``planner.experts.ALL_TO_ALLS_PER_LAYER``, ``dispatch_bytes``). The shapes must agree on
every rank: the batch is padded to the plan's global batch, as under tensor parallelism.
"""
from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from tfplan.apply.collective_ops import member_all_to_all
from tfplan.apply.expert_parallel import is_hub_moe_block, moe_twin
from tfplan.apply.expert_parallel_mixtral import is_mixtral_block, mixtral_twin
from tfplan.apply.expert_parallel_qwen import qwen_moe_twin
from tfplan.apply.groups import Group
from tfplan.apply.spmd.megatron import conjugate
from tfplan.layers.moe import MixtureOfExperts


def all_to_all(x: Any, group: Group, device: str) -> Any:
    """``collective_ops.member_all_to_all`` whose gradient is the all-to-all of the
    gradient (slice i of the result came from member i: its gradient goes back there)."""

    def exchange(v: Any) -> Any:
        return member_all_to_all(v, group, device, "ep")

    return conjugate(x, exchange, exchange)


def exchanged(xe: Any, run_experts: Callable[[Any], Any], group: Group, device: str) -> Any:
    """The experts' outputs for this rank's dispatch buffer ``xe`` ([E, C, d], expert
    order), each slice computed by the rank that holds those experts (module docstring):
    ``run_experts`` runs this rank's experts on [E/ep, ep C, d]."""
    n = group.size
    experts, width = int(xe.shape[0]), tf.shape(xe)[-1]
    local, rows = experts // n, tf.shape(xe)[1]
    got = all_to_all(xe, group, device)  # [n * E/n, C, d]: member i's rows, my experts
    mine = tf.reshape(tf.transpose(tf.reshape(got, tf.stack([n, local, rows, width])),
                                   [1, 0, 2, 3]), tf.stack([local, n * rows, width]))
    out = run_experts(mine)  # [E/n, n C, h]
    h = tf.shape(out)[-1]
    back = tf.reshape(tf.transpose(tf.reshape(out, tf.stack([local, n, rows, h])),
                                   [1, 0, 2, 3]), tf.stack([experts, rows, h]))
    result = all_to_all(back, group, device)  # slice j: rank j's experts on my rows
    return tf.ensure_shape(result, [experts, None, None])


class Exchange:
    """The collectives a twin's ``on_ranks`` runs instead of placed transfers (a plain
    object: Keras does not track it)."""

    def __init__(self, group: Group, device: str) -> None:
        self.group, self.device = group, device

    def __call__(self, xe: Any, run_experts: Callable[[Any], Any]) -> Any:
        return exchanged(xe, run_experts, self.group, self.device)


def is_expert_layer(layer: Any) -> bool:
    """A layer the SPMD engine splits by experts (``MixtureOfExperts`` or keras_hub's
    Mixtral or Qwen-MoE block, not a twin)."""
    return (isinstance(layer, MixtureOfExperts) or is_hub_moe_block(layer)) \
        and not getattr(layer, "is_expert_twin", False)


def expert_twin(layer: Any, original: Any, ep: int, rank: int, group: Group, device: str
                ) -> Any:
    """Rank ``rank``'s twin of the expert layer ``layer`` (a copy's; ``original``: the
    user's, whose aux-loss coefficient a keras_hub block's twin keeps), exchanging over
    ``group`` from ``device``: a ``MixtureOfExperts``' unbuilt, a keras_hub block's built
    (its router and other sub-layers reused, its bank's experts cut)."""
    if is_hub_moe_block(layer):
        make = mixtral_twin if is_mixtral_block(layer) else qwen_moe_twin
        twin = make(layer, original, ep, rank, device)
        twin.expert_bank.exchange_with(Exchange(group, device))
        return twin
    twin = moe_twin(layer, ep, rank, device)
    twin.exchange_with(Exchange(group, device))
    return twin


def shard_ids(layer: Any) -> set[int]:
    """The ids of an expert twin's ``[E/ep, ...]`` weights (a keras_hub block's: its
    bank's)."""
    return {id(v) for v in getattr(layer, "expert_bank", layer).shard_variables()}
