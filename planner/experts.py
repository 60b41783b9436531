"""Mixture-of-experts layers under expert parallelism: which degrees ep a model allows, and
what its experts cost in memory, compute and all-to-all traffic.

Pipeline position: pure functions of a ``LayerProfile``'s mixture-of-experts fields
(``moe_*``, ``profiler.model_profile``), read by ``planner.cost_model`` (capacity padding
in a layer's time), ``planner.candidates`` (the ep degrees searched), ``planner.pricing``
(each candidate's memory, all-to-alls and expert gradient all-reduce), ``planner.search``
(``--fix ep=N``, the reason) and ``planner.validate``. The all-to-all itself is priced in
``planner.collectives.all_to_all_time_s``; which devices an expert group holds is
``expert_group_devices``'s.

The model (DeepSpeed-MoE: Rajbhandari et al., ICML 2022, Sec. 5; GShard: Lepikhin et
al., 2020, Sec. 2-3; Megatron-Core's MoE with expert parallelism carved out of data
parallelism). Symbols: E experts of a layer (``moe_experts``), k top-k (``moe_top_k``),
T tokens per profile batch of b samples (``moe_tokens``), D = T k d x activation bytes
(``moe_dispatch_bytes``), cf the capacity factor (``moe_capacity_factor``, 0: none),
f = ``moe_expert_params`` / ``params`` the experts' share of the layer's state, d = dp x cp
the ranks holding the same weights (``Strategy.replicas``), ep the expert-parallel degree.

- Memory: ep ranks of the data-parallel group hold E/ep experts each, so a layer's
  expert weights, gradients and optimizer state (f of each) are divided by ep; its other
  state (the router) and every other layer stay replicated over d. Each expert then has
  d/ep copies ("expert data parallelism"), and ZeRO shards expert state over those d/ep
  ranks (DeepSpeed-MoE's expert-data-parallel group): per device
  state(W_dense, d) + state(W_expert / ep, d / ep) (``planner.sharding.state_bytes``).
- Activations: with balanced routing a rank receives as many token rows from its ep group
  as it sends, so the expert side keeps as many bytes for the backward as the layer's
  profiled ``activation_saved_bytes`` say at every ep; they are not changed.
- Gradients: the dense ones all-reduced over the d ranks as before, the experts' (/ep)
  over the d/ep ranks holding the same experts (``expert_group_devices``).
- All-to-alls: per MoE layer per micro-batch the forward dispatches tokens to their
  experts' ranks and combines them back, the backward does the same with their
  gradients: ALL_TO_ALLS_PER_LAYER = 4, each moving the rank's dispatch payload
  ``dispatch_bytes`` = D x samples / b x c (c = cf when a capacity factor is set: the
  dispatch buffer is padded to C = cf T k / E rows per expert, E C = cf T k rows in all;
  E / k otherwise: C = T rows per expert, nothing dropped, ``capacity_scale``), of which
  (ep-1)/ep leaves the rank. They are on the critical path (the
  experts wait for their tokens, the next layer for the combined output): priced exposed.
  Full recomputation runs the forward's two again (counted as recomputation time).
- Compute: routing assumed balanced (every expert receives T k / E tokens; GShard's
  auxiliary load-balancing loss aims at this), so a rank computes the same routed expert
  FLOPs whatever ep is: ``flops_fwd`` unchanged by ep. The buffer's padding pads the
  expert matmuls too: their FLOPs scale by c (cf, or E / k without a capacity factor:
  ``padded_expert_flops``).
- Tensor parallelism: a MoE layer is not one ``planner.tp_splits`` splits, so, like every
  such layer, it is replicated over the tp group: every tp rank routes its whole
  micro-batch through the ep group of its own tensor rank (devices a stride tp apart), a
  payload D per rank, the tp groups side by side on their own links. (Megatron-Core can
  also split experts with expert tensor parallelism, exchanging 1/tp of the tokens per
  rank; not modelled: this is the upper bound of that traffic.)
- ``moe_executed_flops_fwd`` (a layer as written that runs every expert on every token)
  is not priced: a plan with expert parallelism runs the routed form.
"""
from __future__ import annotations

from typing import Sequence

from tfplan.core.errors import PlannerError
from tfplan.profiler.model_profile import LayerProfile, ModelProfile

ALL_TO_ALLS_PER_LAYER = 4  # dispatch + combine, forward and backward (module docstring)


def moe_layers(profile: ModelProfile) -> tuple[LayerProfile, ...]:
    """The profile's mixture-of-experts layers (``LayerProfile.is_moe``), in profile order."""
    return tuple(l for l in profile.layers if l.is_moe)


def expert_degrees(profile: ModelProfile, dp: int) -> list[int]:
    """The expert-parallel degrees a dp-way data-parallel group allows: the divisors of dp
    that divide every MoE layer's E (each rank holds a whole E/ep experts of every layer);
    [1] for a model without MoE layers."""
    experts = {l.moe_experts for l in moe_layers(profile)}
    if not experts:
        return [1]
    return [ep for ep in range(1, dp + 1) if dp % ep == 0 and all(e % ep == 0 for e in experts)]


def check_expert_degree(profile: ModelProfile, ep: int, dp: int,
                        error_type: type[PlannerError] = PlannerError) -> None:
    """``error_type`` unless ``ep`` is an expert-parallel degree the model and dp allow
    (``expert_degrees``); ep = 1 is always allowed."""
    if ep == 1:
        return
    layers = moe_layers(profile)
    if not layers:
        raise error_type(f"ep={ep} needs a mixture-of-experts layer; the model "
                         f"{profile.model_name!r} has none. Leave ep out (expert parallelism "
                         "splits experts, and there are none to split).")
    if dp % ep:
        raise error_type(f"ep={ep} does not divide dp={dp}: expert parallelism splits the "
                         "experts over ranks of the data-parallel group. Choose an ep that "
                         f"divides dp, e.g. one of {expert_degrees(profile, dp)}.")
    bad = [l for l in layers if l.moe_experts % ep]
    if bad:
        raise error_type(f"ep={ep} does not divide the {bad[0].moe_experts} experts of layer "
                         f"{bad[0].name!r}: each expert-parallel rank holds a whole E/ep of "
                         f"every MoE layer's experts. Choose one of "
                         f"{expert_degrees(profile, dp)}.")


def expert_share(layer: LayerProfile) -> float:
    """f: the share of the layer's weights (and so of its gradients and optimizer state) in
    its stacked expert weights, moe_expert_params / params; 0 for other layers."""
    if not layer.is_moe or not layer.params:
        return 0.0
    return min(1.0, layer.moe_expert_params / layer.params)


def capacity_scale(layer: LayerProfile) -> float:
    """c: the dispatch buffer's rows over the routed T k. The capacity factor cf when one
    is set (C = cf T k / E rows per expert); without one E / k: the buffer apply runs keeps
    C = T rows per expert so that no token is dropped (``tfplan.layers.routing.capacity``,
    the layer on one device and its expert-parallel twins alike; a dense keras_hub block
    runs every expert on every token, the same E T rows). A dropless exchange of the
    routed rows alone (Megatron-Core's variable-size all-to-all) would be c = 1; apply
    has none (``CollectiveAllToAllV2`` exchanges equal shapes)."""
    if not layer.is_moe:
        return 1.0
    if layer.moe_capacity_factor > 0:
        return layer.moe_capacity_factor
    return layer.moe_experts / layer.moe_top_k if layer.moe_top_k else 1.0


def padded_expert_flops(layer: LayerProfile) -> tuple[float, float]:
    """FLOPs the capacity padding adds to the layer's routed FLOPs (forward, backward):
    (c - 1) F_exp forward and 2 (c - 1) F_exp backward, F_exp = ``moe_expert_flops_fwd``
    (the expert matmuls run on cf T k rows instead of T k; a matmul's backward is twice its
    forward: Narayanan et al., SC'21, Sec. 5.1). Negative when cf < 1 (tokens dropped)."""
    extra = (capacity_scale(layer) - 1.0) * layer.moe_expert_flops_fwd
    return extra, 2.0 * extra


def dispatch_bytes(layer: LayerProfile, samples: float, profile_batch_size: int) -> float:
    """Bytes one rank's dispatch (or combine) all-to-all carries for ``samples`` samples:
    D x samples / b x c (module docstring); 0 for other layers."""
    if not layer.is_moe:
        return 0.0
    return layer.moe_dispatch_bytes * samples / profile_batch_size * capacity_scale(layer)


def expert_group_devices(group: Sequence[int], ep: int, cp: int = 1) -> tuple[
        tuple[int, ...], tuple[int, ...]]:
    """The expert-parallel group and the expert-data-parallel group of the first rank of a
    data-parallel ``group`` (its dp x cp devices in replica order: replica r, context rank
    c at position r cp + c, ``planner.plan``; ``topology.dp_group_devices``). Replicas r and
    r' hold the same experts when r % ep == r' % ep (``Strategy.ep``), so the ep group is
    replicas 0..ep-1 (context rank 0) and the expert-data-parallel group every rank whose
    replica is a multiple of ep (d / ep of them)."""
    ep_group = tuple(group[r * cp] for r in range(ep))
    edp_group = tuple(device for q, device in enumerate(group) if (q // cp) % ep == 0)
    return ep_group, edp_group

