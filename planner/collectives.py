"""Collectives: the one place every transfer and collective the planner prices is priced.

Pipeline position: beside ``planner.cost_model`` (which prices compute, memory and
the pipeline schedule), below everything that prices a candidate: the strategy search
(``planner.search``: plain data parallelism, GPipe boundaries), the hybrid pricing
(``planner.pricing``: tensor-parallel all-reduces, pipeline sends, the data-parallel
gradient all-reduce), the tensor-parallel ILP (``planner.tp_ilp``, through
``planner.tp_splits``) and general placement (``planner.placement_search``) all call
these functions, and none prices a collective itself. Pure functions of bytes, group
sizes and ``LinkSpec``s (alpha: ``latency_s``, beta: ``bandwidth_bytes_per_s``, one
direction), each citing its formula. Which devices a group holds, and which link joins
two devices, is ``planner.topology``'s.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from tfplan.core.cluster import ClusterSpec, LinkSpec
from tfplan.planner.topology import members_per_node


def ring_allreduce_sent_bytes(nbytes: float, n: int) -> float:
    """Bytes one member sends in a ring all-reduce of ``nbytes`` over ``n`` members:
    2 (n-1)/n N (the reduce-scatter's n-1 steps and the all-gather's n-1 steps of N/n;
    Patarasuk & Yuan, JPDC 2009). ``ring_allreduce_time_s`` is this over beta, plus the
    latencies. 0 for n <= 1."""
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


def ring_half_sent_bytes(nbytes: float, n: int) -> float:
    """Bytes one member sends in a ring all-gather of an ``nbytes`` result, in a ring
    reduce-scatter of ``nbytes``, or in a pairwise all-to-all in which each member holds
    ``nbytes``: (n-1)/n N (Thakur, Rabenseifner & Gropp, IJHPCA 2005). 0 for n <= 1."""
    return (n - 1) / n * nbytes if n > 1 else 0.0


def p2p_time_s(nbytes: float, link: LinkSpec) -> float:
    """Point-to-point transfer, alpha-beta model: t = alpha + n / beta.

    alpha: ``link.latency_s``; beta: ``link.bandwidth_bytes_per_s`` (one
    direction); n: bytes (Hockney, "The communication challenge for MPP", 1994).
    """
    return link.latency_s + nbytes / link.bandwidth_bytes_per_s


def ring_allreduce_time_s(nbytes: float, n: int, link: LinkSpec) -> float:
    """Ring all-reduce of ``nbytes`` on ``n`` devices.

    t = 2 (n-1)/n * N / beta + 2 (n-1) * alpha; 0 for n == 1.
    A reduce-scatter then an all-gather, each n-1 steps of N/n bytes
    (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
    workstations", JPDC 2009; NCCL docs, "Performance: algorithm bandwidth vs bus
    bandwidth", bus factor 2(n-1)/n).
    """
    if n < 1:
        raise ValueError(f"all-reduce over {n} devices; expected n >= 1")
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth_bytes_per_s + 2 * (n - 1) * link.latency_s


def ring_allgather_time_s(nbytes: float, n: int, link: LinkSpec) -> float:
    """Ring all-gather of an ``nbytes`` result over ``n`` devices (each holds N/n).

    t = (n-1)/n * N / beta + (n-1) * alpha; 0 for n == 1 (Thakur, Rabenseifner &
    Gropp, "Optimization of collective communication operations in MPICH", IJHPCA
    2005, ring algorithm).
    """
    if n < 1:
        raise ValueError(f"all-gather over {n} devices; expected n >= 1")
    if n == 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth_bytes_per_s + (n - 1) * link.latency_s


def ring_reduce_scatter_time_s(nbytes: float, n: int, link: LinkSpec) -> float:
    """Ring reduce-scatter of ``nbytes`` over ``n`` devices: the mirror of the all-gather,
    same cost t = (n-1)/n * N / beta + (n-1) * alpha (Thakur et al., IJHPCA 2005)."""
    return ring_allgather_time_s(nbytes, n, link)


def pipeline_send_time_s(nbytes: float, tp: int, link: LinkSpec, intra: LinkSpec) -> float:
    """Send a stage's output of ``nbytes`` to the next stage, both split over ``tp``
    tensor-parallel ranks: each rank sends its 1/tp slice over its own link, then the
    next stage's ranks all-gather the slices inside the node:
    t = p2p(N / tp) + all-gather(N, tp) (Narayanan et al., SC'21, Sec. 4.1, the
    scatter/gather optimization; the output is replicated across the tp ranks, so
    sending it whole from every rank would repeat it tp times). tp = 1: t = p2p(N).
    """
    if tp <= 1:
        return p2p_time_s(nbytes, link)
    return p2p_time_s(nbytes / tp, link) + ring_allgather_time_s(nbytes, tp, intra)


def hierarchical_allreduce_time_s(nbytes: float, per_node: int, nodes: int, intra: LinkSpec,
                                  inter: LinkSpec) -> float:
    """All-reduce of ``nbytes`` over ``per_node`` devices in each of ``nodes`` nodes.

    t = RS_intra(N, k) + AR_inter(N / k, nodes) + AG_intra(N, k), k = per_node:
    reduce-scatter inside the node over NVLink, then each of the k devices
    all-reduces its N/k shard with its peers in the other nodes (ring, over its
    own NIC), then an all-gather inside the node (NCCL's tree/ring hierarchy;
    Jia et al., "Highly scalable deep learning training system with mixed-precision",
    2018, hierarchical all-reduce; Sergeev & Del Balso, "Horovod", 2018).
    """
    if nodes <= 1:
        return ring_allreduce_time_s(nbytes, per_node, intra)
    return (ring_reduce_scatter_time_s(nbytes, per_node, intra)
            + ring_allreduce_time_s(nbytes / per_node, nodes, inter)
            + ring_allgather_time_s(nbytes, per_node, intra))


def allreduce_time_s(nbytes: float, per_node: Sequence[int], intra: LinkSpec,
                     inter: LinkSpec | None) -> float:
    """All-reduce of ``nbytes`` over a group with ``per_node[j]`` members on node j
    (``topology.members_per_node``; nodes without members may be listed as 0). n =
    sum of the members.

    - One node (or no inter-node link): a ring on the intra-node link,
      ``ring_allreduce_time_s(N, n, intra)``.
    - k members on each of the M nodes it spans: hierarchical,
      ``hierarchical_allreduce_time_s(N, k, M, intra, inter)``
      = RS_intra(N, k) + AR_inter(N / k, M) + AG_intra(N, k); k = 1 leaves a plain ring
      over the inter-node link.
    - Unequal members per node (e.g. 12 devices on 8-device nodes: 8 + 4): a flat ring
      of n over the slowest link, ``ring_allreduce_time_s(N, n, inter)``. Every one of
      the ring's 2 (n-1) steps moves N/n bytes over every hop at once, so the step
      lasts as long as its slowest hop, the one between nodes (Patarasuk & Yuan, JPDC
      2009, Sec. 3: the ring's time is set by the bandwidth of its slowest link; NCCL
      docs, "Performance", bus bandwidth of a ring = that of its slowest link).
    """
    counts = [k for k in per_node if k]
    n = sum(counts)
    if len(counts) <= 1 or inter is None:
        return ring_allreduce_time_s(nbytes, n, intra)
    if len(set(counts)) == 1:
        return hierarchical_allreduce_time_s(nbytes, counts[0], len(counts), intra, inter)
    return ring_allreduce_time_s(nbytes, n, inter)


def group_allreduce_time_s(nbytes: float, devices: Iterable[int], cluster: ClusterSpec
                           ) -> float:
    """All-reduce of ``nbytes`` over the ``devices`` (node-major indices) of ``cluster``:
    ``allreduce_time_s`` of their members per node. The data-parallel gradient
    all-reduce of every strategy the search prices (its group:
    ``topology.dp_group_devices``; plain data parallelism: devices 0..dp-1). ZeRO-1's
    reduce-scatter + all-gather moves the same bytes (Rajbhandari et al., SC'20,
    Sec. 7)."""
    return allreduce_time_s(nbytes, members_per_node(devices, cluster.devices_per_node),
                            cluster.intra_node_link, cluster.inter_node_link)


def allgather_time_s(nbytes: float, per_node: Sequence[int], intra: LinkSpec,
                     inter: LinkSpec | None) -> float:
    """All-gather of an ``nbytes`` result (each member holds N/n) over a group with
    ``per_node[j]`` members on node j, and likewise a reduce-scatter of ``nbytes``:
    half of ``allreduce_time_s`` for the same group. An all-reduce is a reduce-scatter
    followed by an all-gather of the same N (Patarasuk & Yuan, JPDC 2009), and each of
    the three forms priced there halves exactly: the ring's 2 (n-1) steps become n-1;
    the hierarchical RS_intra + AR_inter(N/k) + AG_intra becomes AR_inter(N/k)/2 +
    AG_intra (RS and AG cost the same); the flat ring over the slowest link halves.
    ZeRO's collectives (Rajbhandari et al., SC'20, Sec. 7: reduce-scatter of gradients,
    all-gather of weights), sequence parallelism's (Korthikanti et al., 2022, Sec. 4.2.2)
    and context parallelism's key/value all-gather are priced with it."""
    return allreduce_time_s(nbytes, per_node, intra, inter) / 2


def tensor_group_allreduce_time_s(nbytes: float, tp: int, cluster: ClusterSpec) -> float:
    """All-reduce of ``nbytes`` over one tensor-parallel group of ``tp`` consecutive
    devices (tensor rank innermost in every layout, so the group of replica 0, stage 0
    is devices 0..tp-1): a ring on the intra-node link when the group fits in a node,
    else ``allreduce_time_s`` of its members per node over the inter-node link (tp=16
    on 8-device nodes: hierarchical over 2 nodes). Megatron-LM keeps tp inside a node
    because of this (Narayanan et al., SC'21, Sec. 3.2); a fixed tp may still span
    nodes."""
    return allreduce_time_s(nbytes, members_per_node(range(tp), cluster.devices_per_node),
                            cluster.intra_node_link, cluster.inter_node_link)


def all_to_all_time_s(nbytes: float, per_node: Sequence[int], intra: LinkSpec,
                      inter: LinkSpec | None) -> float:
    """All-to-all in which every member holds ``nbytes`` (N) and sends N/n of it to each of
    the other n - 1 members (keeping its own N/n), over a group with ``per_node[j]`` members
    on node j (``topology.members_per_node``), n = sum of the members.

    Pairwise exchange: n - 1 transfers of N/n bytes per rank, each costing alpha + (N/n) /
    beta of the link it crosses (Thakur, Rabenseifner & Gropp, "Optimization of collective
    communication operations in MPICH", IJHPCA 2005, the pairwise-exchange all-to-all:
    (p - 1) alpha + (p - 1)/p N beta). A rank with k members on its own node sends k - 1
    slices over the intra-node link and n - k over its inter-node link; NCCL posts all of
    them at once (its all-to-all is a group of ncclSend/ncclRecv to every peer: NCCL docs,
    "Point-to-point communication", all-to-all example), so NVLink and the NIC work side by
    side and the slower of the two sets paces the rank:

        t = max( (k-1) (alpha_intra + N / (n beta_intra)),
                 (n-k) (alpha_inter + N / (n beta_inter)) ),

    k the fewest members any node holds (that rank sends most across nodes). One node (or
    no inter-node link): t = (n-1) (alpha + N / (n beta)) on the intra-node link; n = 1: 0.
    Expert parallelism's token dispatch and combine (Lepikhin et al., "GShard", 2020;
    Rajbhandari et al., "DeepSpeed-MoE", ICML 2022, Sec. 5.2) are priced with it.
    """
    counts = [k for k in per_node if k]
    n = sum(counts)
    if n < 1:
        raise ValueError(f"all-to-all over {n} devices; expected n >= 1")
    if n == 1:
        return 0.0
    share = nbytes / n
    if len(counts) <= 1 or inter is None:
        return (n - 1) * (intra.latency_s + share / intra.bandwidth_bytes_per_s)
    k = min(counts)
    return max((k - 1) * (intra.latency_s + share / intra.bandwidth_bytes_per_s),
               (n - k) * (inter.latency_s + share / inter.bandwidth_bytes_per_s))
