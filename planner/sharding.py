"""What ZeRO stages and offloading cost: memory per device and exposed time per step.

Pipeline position: pure formulas read by ``planner.pricing`` (``Pricer.estimate``) for
every candidate's ``zero_stage`` and ``offload`` (``planner.plan``: ZERO_STAGES,
OFFLOAD). Collectives are priced by ``planner.collectives`` and handed in as seconds;
this module only says which ones a stage runs, how often, what hides them, and which
tensors each device keeps. Works on numbers or numpy arrays (one entry per pipeline
device) alike.

Symbols, per pipeline device (its layers' sums, tensor-parallel shards already divided
by tp): W the weights' bytes (float32 variables), Wc the low-precision copies made for
compute (0 in float32), G the gradients, S the optimizer state; d = dp x cp the ranks
holding the same weights (``Strategy.replicas``); m micro-batches per step.

Memory (Rajbhandari et al., "ZeRO", SC'20, Sec. 5 and Fig. 1: P_os, P_os+g, P_os+g+p):

- stage 0: W + Wc + G + S;  stage 1: W + Wc + G + S/d;
- stage 2: W + Wc + G/d + S/d + one layer's full gradient (the bucket being reduced);
- stage 3: (W + Wc + G + S)/d + 2 x the largest layer's gathered weights (the layer in
  use and the one prefetched: PyTorch FSDP's default backward prefetch of one layer,
  Zhao et al., "PyTorch FSDP", VLDB 2023, Sec. 3.3) + one layer's full gradient.
- offload "optimizer": S lives in host memory (ZeRO-Offload, Ren et al., USENIX ATC'21);
  "optimizer+weights": W too, with the layer in use and the next one fetched to the
  device (ZeRO-Infinity, Rajbhandari et al., SC'21, Sec. 5). Host memory is not
  checked against a capacity (clusters list none).

Time (exposed seconds per step, each stage's collectives overlapping the backward pass
of every layer but the first, as the plain all-reduce does: ``cost_model.exposed_allreduce_s``):

- stages 0 and 1: one gradient all-reduce (ZeRO-1's reduce-scatter + all-gather moves
  the same bytes, SC'20 Sec. 7), during the last micro-batch's backward;
- stage 2: a reduce-scatter of each micro-batch's gradients during its backward (a rank
  keeps only its shard, so it cannot accumulate the others': DeepSpeed's ZeRO-2 reduces
  every micro-step), then an all-gather of the updated weights after the optimizer step,
  exposed;
- stage 3: per micro-batch an all-gather of the weights for the forward (hidden behind the
  forward), again for the backward plus the gradients' reduce-scatter (hidden behind the
  backward); no all-gather after the step (the weights stay sharded). SC'20 Sec. 7.2.2:
  1.5x the plain all-reduce's volume for one micro-batch.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from tfplan.core.cluster import ClusterSpec

# Host side of offloading, for GPU clusters (ClusterSpec lists neither).
# PCIe 4.0 x16: 32 GB/s per direction (PCI-SIG, PCIe 4.0 base specification; NVIDIA A100
# datasheet: "PCIe Gen4 64 GB/s" both directions); ~25 GB/s achieved by cudaMemcpy from
# pinned memory (NVIDIA's bandwidthTest sample on DGX A100).
HOST_LINK_BYTES_PER_S = 25e9
# Host memory bandwidth each GPU's share of the host optimizer gets: DGX A100, two AMD EPYC
# 7742 with 8 channels of DDR4-3200 each, 2 x 204.8 GB/s, shared by 8 GPUs.
HOST_MEMORY_BYTES_PER_S_PER_DEVICE = 2 * 204.8e9 / 8


def host_link_bytes_per_s(cluster: ClusterSpec) -> float:
    """Device<->host bandwidth: PCIe (HOST_LINK_BYTES_PER_S) for GPUs; a CPU device's
    "host" is its own memory (its memory bandwidth)."""
    d = cluster.device
    return d.memory_bandwidth_bytes_per_s if d.device_type == "CPU" else HOST_LINK_BYTES_PER_S


def host_memory_bytes_per_s(cluster: ClusterSpec) -> float:
    """Memory bandwidth the host-side optimizer update of one device gets."""
    d = cluster.device
    return d.memory_bandwidth_bytes_per_s if d.device_type == "CPU" \
        else HOST_MEMORY_BYTES_PER_S_PER_DEVICE


def state_bytes(weights: Any, compute_weights: Any, grads: Any, optimizer: Any, *,
                replicas: int, zero_stage: int, offload: str, largest_gather: Any,
                largest_grad: Any) -> Any:
    """Device bytes of weights, gradients and optimizer state (module docstring, Memory).

    ``largest_gather``/``largest_grad``: the largest single layer's weights for compute
    (Wc, or W in float32) and gradient on the device, unsharded (tensor shards divided)."""
    d = replicas
    opt = 0.0 * optimizer if offload != "none" else \
        optimizer / (d if zero_stage >= 1 else 1)
    grad = grads / d + largest_grad if zero_stage >= 2 and d > 1 else grads
    if zero_stage == 3 and d > 1:
        held = (weights + compute_weights) / d + 2 * largest_gather
    else:
        held = weights + compute_weights
    if offload == "optimizer+weights":
        held = 2 * largest_gather + 0.0 * weights
    return held + grad + opt


def host_state_bytes(weights: Any, optimizer: Any, *, replicas: int, zero_stage: int,
                     offload: str) -> Any:
    """Host bytes one device's share of the offloaded state takes (0 without offload)."""
    if offload == "none":
        return 0.0 * optimizer
    shard = replicas if zero_stage >= 1 else 1
    out = optimizer / shard
    if offload == "optimizer+weights":
        out = out + weights / (replicas if zero_stage == 3 else 1)
    return out


def zero_exposed_s(zero_stage: int, num_microbatches: int, *, allreduce_s: Any,
                   reduce_scatter_s: Any, gather_weights_s: Any, gather_updated_s: Any,
                   forward_s: Any, backward_overlap_s: Any) -> Any:
    """Exposed data-parallel communication per step (module docstring, Time).

    ``allreduce_s``/``reduce_scatter_s``: of the device's gradients over the d ranks;
    ``gather_weights_s``: all-gather of its compute weights; ``gather_updated_s``: of its
    updated weights (stage 2's after-step gather); ``forward_s``: one micro-batch's forward
    time; ``backward_overlap_s``: one micro-batch's backward minus its first layer's."""
    m = num_microbatches
    if zero_stage <= 1:
        return np.maximum(0.0, allreduce_s - backward_overlap_s)
    if zero_stage == 2:
        return m * np.maximum(0.0, reduce_scatter_s - backward_overlap_s) + gather_updated_s
    return m * (np.maximum(0.0, gather_weights_s - forward_s)
                + np.maximum(0.0, gather_weights_s + reduce_scatter_s - backward_overlap_s))


def offload_time_s(offload: str, num_microbatches: int, *, weights: Any, compute_weights: Any,
                   grads: Any, optimizer: Any, shard: int, cluster: ClusterSpec,
                   forward_s: Any, backward_s: Any) -> Any:
    """Seconds per step the offloaded optimizer (and weights) add, replacing the device's
    optimizer update (ZeRO-Offload, Ren et al., ATC'21, Sec. 4: gradients to the host,
    the update on the host, the weights back; priced unoverlapped -- the one-step delayed
    update that hides it changes the training semantics and is not used):

    t = G'/B_link + (2 W' + G' + 2 S')/B_host + W'/B_link (primes: the rank's shard, /shard)

    "optimizer+weights" adds, per micro-batch, fetching the compute weights for the forward
    and again for the backward over the host link, hidden behind each pass's compute as
    ZeRO-3's gathers are (ZeRO-Infinity, SC'21, Sec. 6.2)."""
    if offload == "none":
        return 0.0 * grads
    link, host = host_link_bytes_per_s(cluster), host_memory_bytes_per_s(cluster)
    w, g, s = weights / shard, grads / shard, optimizer / shard
    t = g / link + (2 * w + g + 2 * s) / host + w / link
    if offload == "optimizer+weights":
        fetch = (compute_weights if np.any(compute_weights) else weights) / link
        t = t + num_microbatches * (np.maximum(0.0, fetch - forward_s)
                                    + np.maximum(0.0, fetch - backward_s))
    return t
