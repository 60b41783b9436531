"""Expert-parallel plans (``strategy.ep > 1``): each replica holds 1/ep of every
mixture-of-experts layer's experts; tokens go to their experts' replica and back.

Pipeline position: ``apply.wrap`` calls ``wrap_expert_parallel`` for a plan with ep > 1
(mode ``tensor_parallel``, ``apply.mode``: one host, or worker 0 driving every worker's
devices, ``apply.remote``). It builds ``apply.tensor_parallel``'s data-parallel copies
(replica r on its own devices, one graph, gradients from ``tf.gradients``) with every
``tfplan.layers.MixtureOfExperts`` swapped for ``ExpertParallelMoE``, its expert-parallel
twin; the arithmetic is ``tfplan.layers.routing``'s, shared with the layer, so the twin
computes the same numbers in the same order (GShard, Lepikhin et al., 2020, Sec. 3.2).

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
chunk that changes device, so each replica sends (ep-1)/ep of its dispatch buffer to the
other ranks of its group and receives the same amount of expert output back in the
forward pass, and the backward pass (``tf.gradients`` colocates each gradient op with its
forward op) moves the same bytes again in the opposite direction: per MoE layer and
micro-batch ``2 * 2 * (ep-1)/ep * E * C * d`` elements leave and enter each replica. It is
not a fused collective (no NCCL all-to-all): ep-1 point-to-point transfers each way,
scheduled by TensorFlow's executor, over gRPC between workers.

Gradients: ``tf.gradients`` gives each shard variable the gradient from all of its
group's tokens (every replica of the group read it). ``TensorParallelModel`` then sums a
weight's gradient over its *reduction group* (``set_reduction_groups``): every replica
for the router and the other layers, but for an expert shard only the replicas with the
same ep rank (``r % ep``: expert data parallelism, dp/ep copies); the same hook makes
``set_weights``/``load_weights`` copy each shard from its own rank's first copy and
``global_clipnorm`` count each expert once.

Weights: ``get_weights``/``set_weights``, weight files and the optimizer state in them
(``apply.checkpoint``, through ``full_pieces``) hold the user's unsplit layer (``[E, ...]``
in expert order: group 0's shards concatenated), so files move between the plain model
and any plan. Every shard's variables and optimizer slots live on its replica's device.

Semantics: without a capacity factor (``capacity_factor=None``) no token is dropped and
``aux_loss_weight=0`` adds nothing, so training equals one device. Otherwise the capacity
and the load-balancing loss are computed per replica and micro-batch (GShard's groups);
``moe_group_warning`` says so, and ``apply.wrap`` warns with it for any plan that splits
the batch (also without ep). The aux losses of every replica are included, as their mean
(``TensorParallelModel._forward_loss``), as MirroredStrategy would.

Not run (``ExpertParallelError``, received / expected / fix): ep with tp > 1, cp > 1,
ZeRO (any stage: ``apply.zero``'s owner copies assume every copy equal) or offload
(``apply.dimensions``); a model without a top-level ``MixtureOfExperts``; E not divisible
by ep; a ``MixtureOfExperts`` inside a block or nested model (only top-level layers of
the Functional model are swapped); keras_hub's ``MixtralSparseMoeBlock`` (computes every
expert densely; not swapped yet). Across workers every ep plan runs ``REMOTE`` (worker 0
drives all devices), also when its ep groups lie inside workers.
"""
from __future__ import annotations

from typing import Any, Collection, Sequence

import numpy as np
import tensorflow as tf

from tfplan.apply.sharded_base import Sharded, assign_pieces, concat_variables
from tfplan.apply.tensor_parallel import TensorParallelModel, wrap_tensor_parallel
from tfplan.core.errors import PlanMismatchError
from tfplan.layers.moe import MixtureOfExperts
from tfplan.planner.plan import Plan

EXPERT_SPLIT = "experts"  # the twin's ``tp_split`` (``apply.sharded_base.Sharded``)
DENSE_MOE_BLOCKS = ("MixtralSparseMoeBlock", "QwenMoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock")


class ExpertParallelError(PlanMismatchError):
    """An expert-parallel plan this model or strategy cannot run (see the module docstring)."""


class _Group:
    """The twins of one ep group, rank order (a plain object: Keras does not track it)."""

    def __init__(self, twins: Sequence[Any]) -> None:
        self.twins = tuple(twins)


class ExpertParallelMoE(Sharded, MixtureOfExperts):
    """``MixtureOfExperts`` holding experts ``rank*E/ep .. (rank+1)*E/ep - 1`` of one ep
    group; its ``experts`` runs each chunk of the dispatch buffer on the group member that
    holds those experts (module docstring). Reads and writes the unsplit layer's weights."""

    ep: int = 1
    ep_rank: int = 0
    ep_device: str = ""

    def init_ep(self, ep: int, rank: int, device: str) -> None:
        self.ep, self.ep_rank, self.ep_device = ep, rank, device
        self._init_tp(EXPERT_SPLIT, (device,))
        self._group = _Group(())

    def link(self, twins: Sequence["ExpertParallelMoE"]) -> None:
        """The group's twins, rank order (this one at ``ep_rank``)."""
        self._group = _Group(twins)

    def peers(self) -> tuple["ExpertParallelMoE", ...]:
        """The group's twins, rank order; empty before ``link`` (a method, not an
        attribute: Keras' weight files walk a layer's attributes)."""
        return self._group.twins

    def build(self, input_shape: Any) -> None:
        d = input_shape[-1]
        if d is None:
            raise ValueError("MixtureOfExperts: the input's last dimension (the model width) "
                             f"must be known; received shape {tuple(input_shape)}.")
        e, h = self.num_experts // self.ep, self.expert_hidden
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
        self.built = True

    def experts(self, xe: tf.Tensor, weights: tuple[Any, ...] | None = None) -> tf.Tensor:
        """The layer's experts on ``xe`` ([E, C, d]): chunk j of the E axis on rank j of the
        group, with its shard (placed transfers: the all-to-all, module docstring)."""
        if weights is not None:
            return super().experts(xe, weights)
        peers = self.peers()
        if len(peers) != self.ep:
            raise ExpertParallelError(
                f"Expert-parallel layer {self.name!r} was called before its ep group was "
                f"linked (received {len(peers)} twins, expected ep={self.ep}); build it "
                "through apply.wrap (apply.expert_parallel.wrap_expert_parallel).")
        chunks = tf.split(xe, self.ep, axis=0)
        outputs = []
        for peer, chunk in zip(peers, chunks):
            with tf.device(peer.ep_device):  # that rank's experts, on its device
                outputs.append(MixtureOfExperts.experts(peer, chunk, peer.expert_weights()))
        return tf.concat(outputs, axis=0)  # back on this replica's device

    # --- unsplit weights (apply.sharded_base.Sharded) ------------------------------------
    def _stacked(self) -> list[int]:
        """Indices into ``self.weights`` of the stacked expert weights (all but the router)."""
        return list(range(1, len(self.weights)))

    def full_pieces(self) -> list[tuple[tuple[Any, ...], int | None]]:
        group = self.peers() or (self,)
        out: list[tuple[tuple[Any, ...], int | None]] = [((self.router_kernel,), None)]
        for i in self._stacked():
            out.append((tuple(t.weights[i] for t in group), 0 if self.peers() else None))
        return out

    def full_weights(self) -> list[np.ndarray]:
        if not self.peers() and self.ep > 1:
            raise ExpertParallelError(
                f"Expert-parallel layer {self.name!r} holds 1/{self.ep} of the experts and "
                "its ep group is not linked (received no group, expected ep="
                f"{self.ep} twins): its unsplit weights cannot be read. Wrap the model with "
                "apply.wrap.")
        return [np.asarray(shards[0].numpy()) if axis is None
                else concat_variables(shards, axis) for shards, axis in self.full_pieces()]

    def set_full_weights(self, weights: Sequence[Any]) -> None:
        if len(weights) != len(self.weights):
            raise ValueError(f"Layer {self.name!r} has {len(self.weights)} weight arrays "
                             f"(unsplit, as MixtureOfExperts); received {len(weights)}.")
        self.router_kernel.assign(np.asarray(weights[0]))
        for i in self._stacked():
            full = np.asarray(weights[i])
            if self.peers():  # every rank of the group its slice
                assign_pieces([t.weights[i] for t in self.peers()], full, 0)
            else:  # not linked yet (while the replicas are built): this rank's slice
                n = full.shape[0] // self.ep
                self.weights[i].assign(full[self.ep_rank * n:(self.ep_rank + 1) * n])


# the user's class in weight files (Keras names a layer's entry after its class) and in
# saved models: a wrapped model's files are the plain model's (apply.sharded_layers does
# the same for its twins)
ExpertParallelMoE.__name__ = MixtureOfExperts.__name__
ExpertParallelMoE.__module__ = MixtureOfExperts.__module__


# --- which layers, and the checks --------------------------------------------------------------

def _all_layers(view: Any) -> list[Any]:
    flatten = getattr(view, "_flatten_layers", None)
    return list(flatten(include_self=False, recursive=True)) if flatten else []


def moe_layers(view: Any) -> list[Any]:
    """Every ``MixtureOfExperts`` in ``view``, at any depth."""
    return [layer for layer in _all_layers(view) if isinstance(layer, MixtureOfExperts)]


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
    if not grouped:
        return None
    return (f"Plan {plan.name!r} routes each replica's micro-batch on its own ({s.dp} "
            f"replica(s) x {max(1, s.cp)} context chunk(s) x {s.num_microbatches} "
            f"micro-batch(es)), and mixture-of-experts layer(s) {grouped} have a capacity "
            "factor or a load-balancing loss: the capacity (which tokens are dropped) and "
            "the aux loss are computed per group of tokens (GShard's groups; the aux losses "
            "averaged over the replicas), so training differs from one device's. "
            "capacity_factor=None and aux_loss_weight=0 train like one device.")


def check_expert_parallel(plan: Plan, view: Any) -> list[Any]:
    """The top-level MixtureOfExperts layers an ep plan splits; ExpertParallelError for
    what it cannot run (module docstring)."""
    s = plan.strategy
    ep = s.ep
    hub = [type(layer).__name__ for layer in _all_layers(view)
           if type(layer).__name__ in DENSE_MOE_BLOCKS]
    if hub:
        raise ExpertParallelError(
            f"Plan {plan.name!r} has ep={ep}, and the model's mixture-of-experts blocks are "
            f"keras_hub's {sorted(set(hub))}, which apply does not split by experts yet "
            "(expected tfplan.layers.MixtureOfExperts layers). Re-plan with ep=1 "
            "(plan analyze --fix ep=1), or build the model with "
            "tfplan.layers.MixtureOfExperts.")
    top = {id(layer) for layer in view.layers}
    layers = moe_layers(view)
    inner = [layer.name for layer in layers if id(layer) not in top]
    if inner:
        raise ExpertParallelError(
            f"Plan {plan.name!r} has ep={ep}; MixtureOfExperts layer(s) {inner} sit inside "
            "a block or nested model, and apply splits only the Functional model's own "
            "MixtureOfExperts layers by experts (expected them at the top level). Call the "
            "MixtureOfExperts layer in the Functional model itself, or re-plan with ep=1.")
    if not layers:
        raise ExpertParallelError(
            f"Plan {plan.name!r} has ep={ep} (expert parallelism), but model "
            f"{view.name!r} has no tfplan.layers.MixtureOfExperts layer (received none, "
            "expected at least one): there are no experts to split. Re-plan with ep=1.")
    for layer in layers:
        if layer.num_experts % ep:
            raise ExpertParallelError(
                f"Plan {plan.name!r} has ep={ep}, but MixtureOfExperts layer {layer.name!r} "
                f"has num_experts={layer.num_experts} (expected a multiple of ep: each "
                "rank holds num_experts/ep experts). Re-plan with an ep that divides "
                f"{layer.num_experts}, or change num_experts.")
    return layers


# --- wrapping ------------------------------------------------------------------------------------

def wrap_expert_parallel(view: Any, plan: Plan, device_of_layer: dict[str, str], *,
                         recompute_layers: Collection[str] = ()) -> TensorParallelModel:
    """``apply.tensor_parallel.wrap_tensor_parallel`` with every top-level
    MixtureOfExperts re-created as replica r's ``ExpertParallelMoE`` (rank r % ep), the
    twins of each ep group linked, and each expert shard's gradient summed over the
    replicas of its ep rank only (module docstring)."""
    s = plan.strategy
    ep, dp = s.ep, s.dp
    names = {layer.name for layer in check_expert_parallel(plan, view)}

    def substitute(layer: Any, r: int, device: str) -> Any:
        if layer.name not in names:
            return None
        twin = ExpertParallelMoE.from_config(layer.get_config())
        twin.init_ep(ep, r % ep, device)
        return twin

    model = wrap_tensor_parallel(view, plan, device_of_layer,
                                 recompute_layers=recompute_layers, substitute=substitute)
    replicas = model.replica_models()
    groups = tuple(tuple(range(k, dp, ep)) for k in range(ep))  # same rank: same experts
    partial: dict[int, tuple[tuple[int, ...], ...]] = {}
    for name in names:
        twins = [m.get_layer(name) for m in replicas]
        for g in range(dp // ep):
            members = twins[g * ep:(g + 1) * ep]
            for twin in members:
                twin.link(members)
        first = twins[0]
        for i in first._stacked():
            partial[id(first.weights[i])] = groups
    model.set_reduction_groups(partial)
    return model
