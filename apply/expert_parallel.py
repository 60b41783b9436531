"""Expert-parallel plans (``strategy.ep > 1``): each replica holds 1/ep of every
mixture-of-experts layer's experts; tokens go to their experts' replica and back.

Pipeline position: ``apply.wrap`` calls ``wrap_expert_parallel`` for a plan with ep > 1
(mode ``tensor_parallel``, ``apply.mode``) on one host, for a model the SPMD engine
refuses. It builds ``apply.tensor_parallel``'s data-parallel copies
(replica r on its own devices, one graph, gradients from ``tf.gradients``) with every
``tfplan.layers.MixtureOfExperts`` swapped for ``ExpertParallelMoE``, its expert-parallel
twin: a top-level one as the replica is cloned, one inside a block (a custom layer, at
any depth) swapped into the built block in place (``apply.blocks.swap_in``); keras_hub's
``MixtralSparseMoeBlock`` likewise for ``apply.expert_parallel_mixtral``'s routed twin, and
Qwen-MoE's ``QwenSparseMoeBlock`` for ``apply.expert_parallel_qwen``'s (its shared expert
replicated; the parts the two share in ``apply.expert_parallel_hub``).
The arithmetic is ``tfplan.layers.routing``'s, shared with the layer, so the twin
computes the same numbers in the same order (GShard, Lepikhin et al., 2020, Sec. 3.2).
The shard bookkeeping (links, placed chunks, unsplit weights) is
``apply.expert_group.ExpertShards``'.

Layout (``planner.plan.Strategy.ep``): replica r has ep rank ``k = r % ep`` and ep group
``g = r // ep``; the ep replicas ``g*ep .. g*ep+ep-1`` of group g together hold every
expert once. Replica r's twin is built on replica r's device and holds experts
``k*E/ep .. (k+1)*E/ep - 1``: the ``[E/ep, ...]`` slices of each stacked expert weight
(``MixtureOfExperts.expert_weights``). The router ``[d, E]`` is replicated like any weight.
The twins of one group hold references to each other (``peers``, set after every replica
is built, out of Keras' sight): each twin tracks, builds and saves only its own shard.

Forward of replica r (the layer's own ``call``; only ``experts`` differs): route and
dispatch on r's device give the buffer ``[E, C, d]`` (C = the replica's tokens T without a
capacity factor); it is split along E into ep chunks; chunk j runs under ``tf.device`` of
replica ``g*ep + j`` with that replica's twin's expert variables; the ep outputs are
concatenated back on r's device for the combine. This is the all-to-all of expert
parallelism realised as placed transfers: TensorFlow inserts a Send/Recv pair for every
chunk that changes device. In the forward pass each replica sends (ep-1)/ep of its
dispatch buffer (``E * C * d`` elements) to the other ranks of its group and receives
their experts' outputs for it (the same amount) back, and, as the holder of its own
experts, receives the same amount of the other ranks' rows and sends their outputs back;
the backward pass (``tf.gradients`` colocates each gradient op with its forward op) moves
the gradients of the same tensors the opposite way. Per MoE layer and micro-batch each
replica sends ``4 * (ep-1)/ep * E * C * d`` elements and receives as many (C = its tokens
T without a capacity factor); weights never move (each chunk reads its rank's own
variables there). It is not a fused collective (no NCCL all-to-all): 2 (ep-1) sends and
2 (ep-1) receives per replica in each pass, point to point, scheduled by TensorFlow's
executor (over gRPC between workers).

Gradients: ``tf.gradients`` gives each shard variable the gradient from all of its
group's tokens (every replica of the group read it). ``TensorParallelModel`` then sums a
weight's gradient over its *reduction group* (``set_reduction_groups``): every replica
for the router and the other layers, but for an expert shard only the replicas with the
same ep rank (``r % ep``: expert data parallelism, dp/ep copies); the same hook makes
``set_weights``/``load_weights`` copy each shard from its own rank's first copy and
``global_clipnorm`` count each expert once. Under ZeRO-1 and ZeRO-2 (``apply.zero``)
each part is one weight group: its gradient reduced onto one owner among the replicas
with that ep rank, the owner alone holding the shard's optimizer slots and updating it,
the new value copied to the part's other replicas (dense weights: owners over all dp
replicas, as without ep). Which replica owns which shard: ``apply.zero``'s docstring.

Weights: ``get_weights``/``set_weights``, weight files and the optimizer state in them
(``apply.checkpoint``, through ``full_pieces``) hold the user's unsplit layer (``[E, ...]``
in expert order: group 0's shards concatenated), so files move between the plain model
and any plan. Every shard's variables live on its replica's device, and so do its
optimizer slots (under ZeRO-1/2 on its owner's replica only).

Semantics: without a capacity factor (``capacity_factor=None``) no token is dropped and
``aux_loss_weight=0`` adds nothing, so training equals one device. Otherwise the capacity
and the load-balancing loss are computed per replica and micro-batch (GShard's groups);
``moe_group_warning`` says so, and ``apply.wrap`` warns with it for any plan that splits
the batch (also without ep). The aux losses of every replica are included, as their mean
(``TensorParallelModel._forward_loss``), as MirroredStrategy would.

Not run (``ExpertParallelError``, received / expected / fix; the strategy rules in
``apply.dimensions``): ep with tp > 1, cp > 1, ZeRO-3 (``apply.zero3`` keeps one
persistent copy of every weight for all replicas; an expert shard differs per ep rank)
or offload; a model without a
``MixtureOfExperts``, Mixtral or Qwen-MoE block; E not divisible by ep; a MoE layer that is
a layer of a nested Functional model (its graph is not re-wired); keras_hub's other MoE
blocks (Qwen3-MoE's, Qwen3.5-MoE's, GPT-OSS's: ``refused_moe_block``).
Across workers an ep plan runs one program per worker on the SPMD engine
(``apply.spmd.experts``: the all-to-alls span the workers).

Deviation from the design brief: the twins live in ``apply.tensor_parallel``'s copies (a
``substitute`` hook there, ``set_reduction_groups`` for the per-weight reduction), not a
model class of their own; the dispatch buffer has C = T rows per expert without a
capacity factor (``tfplan.layers.routing``), so each transfer is E/ep x T x d per chunk,
``E / top_k`` times the routed tokens: set a capacity factor for real runs.
"""
from __future__ import annotations

from typing import Any, Callable, Collection

import keras
import numpy as np
import tensorflow as tf

from tfplan import compat
from tfplan.apply.blocks import swap_in
from tfplan.apply.expert_group import ExpertParallelError, ExpertShards
from tfplan.apply.expert_parallel_mixtral import is_mixtral_block, mixtral_twin
from tfplan.apply.expert_parallel_qwen import is_qwen_moe_block, qwen_moe_twin
from tfplan.apply.layer_tree import scopes_of
from tfplan.apply.placement import tf_variable
from tfplan.apply.sharded_base import Sharded, concat_variables
from tfplan.apply.tensor_parallel import TensorParallelModel, wrap_tensor_parallel
from tfplan.layers.moe import MixtureOfExperts
from tfplan.planner.plan import Plan

__all__ = ["ExpertParallelError", "ExpertParallelMoE", "check_expert_parallel",
           "moe_group_warning", "wrap_expert_parallel"]

def is_hub_moe_block(layer: Any) -> bool:
    """keras_hub's Mixtral or Qwen-MoE block (one apply splits by experts, not a twin)."""
    return is_mixtral_block(layer) or is_qwen_moe_block(layer)


# keras_hub's other MoE blocks (Qwen3SparseMoeBlock, Qwen3_5MoeSparseMoeBlock,
# GptOssSparseMoeBlock: dense experts): not split by experts yet; keras_hub names every
# such block "...SparseMoeBlock"
def refused_moe_block(layer: Any) -> bool:
    """A keras_hub MoE block apply does not split by experts (every one but Mixtral's and
    Qwen-MoE's, and not their twins)."""
    return type(layer).__name__.endswith("SparseMoeBlock") and not is_hub_moe_block(layer) \
        and not getattr(layer, "is_expert_twin", False)


class ExpertParallelMoE(ExpertShards, Sharded, MixtureOfExperts):
    """``MixtureOfExperts`` holding experts ``rank*E/ep .. (rank+1)*E/ep - 1`` of one ep
    group; its ``experts`` runs each chunk of the dispatch buffer on the group member that
    holds those experts (module docstring). Reads and writes the unsplit layer's weights."""

    is_expert_twin = True

    def local_experts(self) -> int:
        return self.num_experts // self.ep

    def build(self, input_shape: Any) -> None:
        super().build(input_shape)  # the layer's weights, E / ep experts of them
        self.built = True

    def shard_variables(self) -> list[Any]:
        return [v for v in self.expert_weights() if v is not None]

    def experts(self, xe: tf.Tensor, weights: tuple[Any, ...] | None = None) -> tf.Tensor:
        """The layer's experts on ``xe`` ([E, C, d]): chunk j of the E axis on rank j of the
        group, with its shard (placed transfers: the all-to-all, module docstring)."""
        if weights is not None:
            return super().experts(xe, weights)
        return self.on_ranks(xe, lambda peer, chunk: MixtureOfExperts.experts(
            peer, chunk, peer.expert_weights()))

    # --- unsplit weights (apply.sharded_base.Sharded) ------------------------------------
    def full_pieces(self) -> list[tuple[tuple[Any, ...], int | None]]:
        return [((self.router_kernel,), None), *self.stacked_pieces()]

    def full_weights(self) -> list[np.ndarray]:
        self.check_linked()
        return [np.asarray(shards[0].numpy()) if axis is None
                else concat_variables(shards, axis) for shards, axis in self.full_pieces()]

    def set_full_weights(self, weights: list[Any] | tuple[Any, ...]) -> None:
        if len(weights) != len(self.weights):
            raise ValueError(f"Layer {self.name!r} has {len(self.weights)} weight arrays "
                             f"(unsplit, as MixtureOfExperts); received {len(weights)}.")
        self.router_kernel.assign(np.asarray(weights[0]))
        self.assign_stacked(weights[1:])


# the user's class in weight files (Keras names a layer's entry after its class) and in
# saved models: a wrapped model's files are the plain model's (apply.sharded_layers does
# the same for its twins)
ExpertParallelMoE.__name__ = MixtureOfExperts.__name__
ExpertParallelMoE.__module__ = MixtureOfExperts.__module__
compat.serialize_as(ExpertParallelMoE, MixtureOfExperts)  # tfplan>MixtureOfExperts


def moe_twin(layer: Any, ep: int, rank: int, device: str) -> ExpertParallelMoE:
    """An unbuilt ``ExpertParallelMoE`` with ``layer``'s configuration, rank ``rank``."""
    twin = ExpertParallelMoE.from_config(layer.get_config())
    twin.init_ep(ep, rank, device)
    return twin


def _inner_moe_twin(layer: Any, original: Any, ep: int, rank: int, device: str
                    ) -> ExpertParallelMoE:
    """``moe_twin`` of a built sub-layer, built on ``device`` with its shapes and weights
    (``original``, the user's layer, has the same configuration)."""
    twin = moe_twin(layer, ep, rank, device)
    with tf.device(device), scopes_of(layer):  # variable paths as the layer's
        twin.build(**compat.build_arguments(layer))
    twin.set_full_weights(layer.get_weights())  # this rank's slice (not linked yet)
    return twin


# --- which layers, and the checks --------------------------------------------------------------

def _sublayers(layer: Any) -> list[Any]:
    flatten = getattr(layer, "_flatten_layers", None)
    return list(flatten(include_self=False, recursive=False)) if flatten else []


def _is_expert_layer(layer: Any) -> bool:
    return isinstance(layer, MixtureOfExperts) or is_hub_moe_block(layer)


def expert_layers(model: Any) -> list[tuple[Any, Any]]:
    """(parent, layer) for every MoE layer (``MixtureOfExperts``, keras_hub's Mixtral
    and Qwen-MoE blocks) in ``model``, depth first in Keras' tracking order; ``model`` is
    the parent of its own top-level ones. Expert twins already swapped in are not listed."""
    out: list[tuple[Any, Any]] = []

    def walk(parent: Any, layers: list[Any]) -> None:
        for layer in layers:
            if getattr(layer, "is_expert_twin", False):
                continue
            if _is_expert_layer(layer):
                out.append((parent, layer))
            else:
                walk(layer, _sublayers(layer))
    walk(model, list(model.layers))
    return out


def moe_layers(view: Any) -> list[Any]:
    """Every ``MixtureOfExperts`` in ``view``, at any depth."""
    flatten = getattr(view, "_flatten_layers", None)
    layers = list(flatten(include_self=False, recursive=True)) if flatten else []
    return [layer for layer in layers if isinstance(layer, MixtureOfExperts)]


def moe_group_warning(plan: Plan, view: Any) -> str | None:
    """The sentence ``apply.wrap`` warns with when ``plan`` splits each step's tokens into
    groups (dp x cp x micro-batches > 1) and a MoE layer's capacity or load-balancing loss
    depends on them (GShard's groups); None when training equals one device."""
    s = plan.strategy
    parts = s.dp * max(1, s.cp) * s.num_microbatches
    if parts <= 1:
        return None
    grouped = [layer.name for layer in moe_layers(view)
               if layer.capacity_factor is not None or layer.aux_loss_weight > 0]
    grouped += [layer.name for _, layer in expert_layers(view)
                if is_mixtral_block(layer) and layer.router_aux_loss_coef > 0
                or is_qwen_moe_block(layer) and layer.router_aux_loss_coefficient > 0]
    if not grouped:
        return None
    return (f"Plan {plan.name!r} routes each replica's micro-batch on its own ({s.dp} "
            f"replica(s) x {max(1, s.cp)} context chunk(s) x {s.num_microbatches} "
            f"micro-batch(es)), and mixture-of-experts layer(s) {grouped} have a capacity "
            "factor or a load-balancing loss: the capacity (which tokens are dropped) and "
            "the aux loss are computed per group of tokens (GShard's groups; the aux losses "
            "averaged over the replicas), so training differs from one device's. "
            "capacity_factor=None and aux_loss_weight=0 (router_aux_loss_coef=0, "
            "router_aux_loss_coefficient=0) train like one device.")


def check_expert_parallel(plan: Plan, view: Any) -> list[tuple[Any, Any]]:
    """``expert_layers(view)``, the MoE layers an ep plan splits; ExpertParallelError for
    what it cannot run (module docstring)."""
    ep = plan.strategy.ep
    flatten = getattr(view, "_flatten_layers", None)
    every = list(flatten(include_self=False, recursive=True)) if flatten else []
    other = sorted({type(layer).__name__ for layer in every if refused_moe_block(layer)})
    if other:
        raise ExpertParallelError(
            f"Plan {plan.name!r} has ep={ep}, and the model's mixture-of-experts blocks are "
            f"keras_hub's {other}, which apply does not split by experts yet (expected "
            "tfplan.layers.MixtureOfExperts, keras_hub's MixtralSparseMoeBlock or "
            "QwenSparseMoeBlock). Re-plan with ep=1 (plan analyze --fix ep=1).")
    found = expert_layers(view)
    if not found:
        raise ExpertParallelError(
            f"Plan {plan.name!r} has ep={ep} (expert parallelism), but model "
            f"{view.name!r} has no tfplan.layers.MixtureOfExperts layer, Mixtral or "
            "Qwen-MoE block "
            "(received none, expected at least one): there are no experts apply can split. "
            "A mixture of experts written as a layer of your own is priced by the planner "
            "(profiler.moe recognises it by structure) but not split by apply: build it "
            "with tfplan.layers.MixtureOfExperts, or re-plan with ep=1.")
    for parent, layer in found:
        if parent is not view and isinstance(parent, keras.Model):
            raise ExpertParallelError(
                f"Plan {plan.name!r} has ep={ep}; mixture-of-experts layer {layer.name!r} is "
                f"a layer of nested model {parent.name!r}, whose graph apply does not re-wire "
                "(expected it at the top level of the model, or inside a block: a custom "
                "layer). Call it in the outer Functional model, or re-plan with ep=1.")
        if parent is view and is_hub_moe_block(layer):
            raise ExpertParallelError(
                f"Plan {plan.name!r} has ep={ep}; keras_hub MoE block {layer.name!r} "
                f"({type(layer).__name__}) is called directly in the Functional model "
                "(expected it inside its transformer decoder block). Re-plan with ep=1.")
        if layer.num_experts % ep:
            raise ExpertParallelError(
                f"Plan {plan.name!r} has ep={ep}, but mixture-of-experts layer "
                f"{layer.name!r} has num_experts={layer.num_experts} (expected a multiple "
                "of ep: each rank holds num_experts/ep experts). Re-plan with an ep that "
                f"divides {layer.num_experts}, or change num_experts.")
    return found


# --- wrapping ------------------------------------------------------------------------------------

# (the replica's built layer, the user's, ep, rank, device) -> the replica's twin
Twin = Callable[[Any, Any, int, int, str], Any]


def _twin_maker(layer: Any) -> Twin:
    if is_mixtral_block(layer):
        return mixtral_twin
    return qwen_moe_twin if is_qwen_moe_block(layer) else _inner_moe_twin


def _shards_of(twin: Any) -> ExpertShards:
    """The part of a swapped-in twin that holds the experts (a keras_hub block's bank)."""
    return twin if isinstance(twin, ExpertShards) else twin.expert_bank


def wrap_expert_parallel(view: Any, plan: Plan, device_of_layer: dict[str, str], *,
                         recompute_layers: Collection[str] = ()) -> TensorParallelModel:
    """``apply.tensor_parallel.wrap_tensor_parallel`` with every MoE layer re-created as
    replica r's expert-parallel twin (rank r % ep): a top-level ``MixtureOfExperts`` when
    the replica is cloned, one inside a block (a Mixtral or Qwen-MoE block too) swapped into the
    built block; the twins of each ep group linked, and each expert shard's gradient
    summed over the replicas of its ep rank only (module docstring)."""
    s = plan.strategy
    ep, dp = s.ep, s.dp
    top = {layer.name for parent, layer in check_expert_parallel(plan, view)
           if parent is view}

    def substitute(layer: Any, r: int, device: str) -> Any:
        return moe_twin(layer, ep, r % ep, device) if layer.name in top else None

    model = wrap_tensor_parallel(view, plan, device_of_layer,
                                 recompute_layers=recompute_layers, substitute=substitute)
    replicas = model.replica_models()
    originals = [layer for parent, layer in expert_layers(view) if parent is not view]
    twins: list[list[ExpertShards]] = []  # per replica, in the same order
    for r, replica in enumerate(replicas):
        mine = [_shards_of(replica.get_layer(name)) for name in sorted(top)]
        inner = expert_layers(replica)  # inside blocks: swapped in place
        if len(inner) != len(originals):
            raise ExpertParallelError(
                f"Plan {plan.name!r}: replica {r} of model {view.name!r} holds {len(inner)} "
                f"mixture-of-experts layers inside blocks, the model {len(originals)} "
                "(expected the same: a block's get_config must re-create its sub-layers). "
                "Re-plan with ep=1.")
        for (parent, layer), original in zip(inner, originals):
            device = tf_variable(layer.weights[0]).device  # where the replica built it
            twin = _twin_maker(layer)(layer, original, ep, r % ep, device)
            swap_in(parent, layer, twin)
            mine.append(_shards_of(twin))
        twins.append(mine)
    groups = tuple(tuple(range(k, dp, ep)) for k in range(ep))  # same rank: same experts
    partial: dict[int, tuple[tuple[int, ...], ...]] = {}
    for i, first in enumerate(twins[0]):
        for g in range(dp // ep):
            members = [twins[r][i] for r in range(g * ep, (g + 1) * ep)]
            for twin in members:
                twin.link(members)
        for v in first.shard_variables():
            partial[id(v)] = groups
    model.set_reduction_groups(partial)
    return model
