"""The cost model: pure functions from profile numbers and hardware to seconds and bytes.

Pipeline position: read by ``planner.search`` and ``planner.pricing`` (to price each
candidate), ``planner.tp_splits`` and, through the per-layer numbers the search hands
them, the ILPs. Every function is pure, names its symbols, and cites where its formula
comes from. Transfers and collectives are priced in ``planner.collectives``, nowhere
else.

Profile numbers are for ``ModelProfile.batch_size`` samples (b); a cost for
``samples`` samples scales them linearly: ``value * samples / b``.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

from tfplan.core.cluster import ClusterSpec, DeviceSpec
from tfplan.planner.experts import padded_expert_flops
from tfplan.planner.plan import Breakdown
from tfplan.profiler.model_profile import LayerProfile

# Fixed cost of one layer in one micro-batch pass (its forward and backward ops
# together): kernel launch (~5 us per CUDA launch, NVIDIA CUDA best-practices
# guide) plus TensorFlow op dispatch inside a tf.function. Assumed 10 us. It is
# what makes more micro-batches not free.
LAYER_OVERHEAD_S = 10e-6

# Allocator/workspace margin on every memory estimate. TensorFlow's BFC allocator
# rounds allocations to size bins and fragments; cuBLAS/cuDNN take workspaces.
# ZeRO (Rajbhandari et al., SC'20, Sec. 3.2) reports fragmentation that leaves
# >30% of memory unusable in extreme cases; 10% is our assumption for the common
# case, to be calibrated against measured peaks.
MEMORY_MARGIN = 1.10


def scaled(value_for_profile_batch: float, samples: float, profile_batch_size: int) -> float:
    """A per-layer profile number for ``samples`` samples: value * samples / b (linear)."""
    return value_for_profile_batch * samples / profile_batch_size


def compute_time_s(flops: float, device: DeviceSpec, precision: str) -> float:
    """t = F / (P_peak(precision) * eta).

    F: FLOPs (2 per multiply-add); P_peak: the device's dense peak for the
    precision its matmuls run in; eta: ``device.matmul_efficiency`` (see
    ``planner.presets`` for the figure and its source).
    """
    return flops / device.achieved_flops(precision)


def layer_overhead_s(device: DeviceSpec) -> float:
    """The fixed cost of one layer's forward + backward in one pass: the device's measured
    ``layer_overhead_s`` (``plan profile-hardware``) where it has one, else LAYER_OVERHEAD_S."""
    return device.layer_overhead_s if device.layer_overhead_s is not None else LAYER_OVERHEAD_S


def vector_flops(device: DeviceSpec, precision: str) -> float:
    """FLOP/s of the ops that are not contractions (element-wise, reductions): the
    device's plain float32 peak (no tensor cores), or its matmul peak if it lists none."""
    return dict(device.peak_flops_per_s).get("float32") or device.peak_flops(precision)


def roofline_time_s(matmul_flops: float, other_flops: float, traffic_bytes: float,
                    device: DeviceSpec, precision: str) -> float:
    """Time of one layer's ops in one pass, by op class (roofline: Williams, Waterman &
    Patterson, "Roofline", CACM 2009):

    t = F_mm / (P_peak(precision) * eta) + max(F_other / P_vector, T / B_mem)

    F_mm: FLOPs in contractions (MatMul, Einsum, Conv), compute-bound at the matmul
    rate ``compute_time_s``; F_other: the other ops' FLOPs at the vector rate
    ``vector_flops``; T: the bytes those other ops read and write
    (``LayerProfile.memory_traffic_bytes_*``), at the device's memory bandwidth B_mem
    (datasheet for presets, measured by ``plan profile-hardware``). Element-wise ops,
    softmax and normalizations do about one FLOP per byte, far below the ridge point,
    so their time is their traffic: this is what makes small and normalization-heavy
    layers slower than their FLOPs say.
    """
    t = compute_time_s(matmul_flops, device, precision) if matmul_flops else 0.0
    if other_flops or traffic_bytes:
        t += max(other_flops / vector_flops(device, precision),
                 traffic_bytes / device.memory_bandwidth_bytes_per_s)
    return t


def fuses_elementwise(device: DeviceSpec) -> bool:
    """Whether training on ``device`` fuses element-wise ops into few kernels: on GPUs,
    Keras 3 compiles the train step with XLA (``jit_compile="auto"`` resolves to True
    when a non-CPU device is present: ``Trainer._resolve_auto_jit_compile`` in Keras'
    trainers/trainer.py) and Megatron-LM uses fused kernels (fused bias-GELU,
    scale-mask-softmax, layer norm: Narayanan et al., SC'21, Sec. 4.2); on CPU-only
    hosts Keras disables XLA and TensorFlow's executor runs every op on its own."""
    return device.device_type != "CPU"


def fused_traffic_bytes(layer: LayerProfile) -> tuple[float, float]:
    """Bytes a layer's non-contraction ops move when they are fused (forward, backward):
    the forward reads the layer's inputs and writes its outputs and the tensors it saves
    for the backward, once: I + A + S; the backward reads the output gradient and the
    saved tensors and writes the input gradient: 2 (I + A + S) as an upper bound.
    (Fusion keeps the intermediates in registers or on chip: the traffic of a fused
    kernel is its inputs and outputs; Williams et al., "Roofline", CACM 2009, Sec. 3.)"""
    once = layer.input_bytes + layer.activation_bytes + layer.activation_saved_bytes
    return float(once), 2.0 * once


def layer_fwd_bwd_time_s(layer: LayerProfile, samples: float, profile_batch_size: int,
                         device: DeviceSpec, precision: str, divide: int = 1,
                         measured_batch_size: int = 0) -> tuple[float, float]:
    """Forward and backward time of one layer for one pass over ``samples`` samples, its
    work divided over ``divide`` devices (a tensor-parallel split), each with half the
    layer overhead: ``roofline_time_s`` of the layer's numbers scaled to the samples.

    Profiles without the op-class split (``LayerProfile.has_op_classes`` false) price
    every FLOP as a contraction, as before the split was recorded. A mixture-of-experts
    layer with a capacity factor adds its padded expert matmuls
    (``experts.padded_expert_flops``) to both its FLOPs and its contractions.

    A layer with measured times (``profiler.calibrate``: ``measured_fwd_s`` for
    ``measured_batch_size`` samples) is priced from them instead, the overhead kept
    fixed and the rest scaled with the samples: t = o/2 + max(0, t_meas - o/2) x
    samples / (b_meas x divide).
    """
    f = samples / profile_batch_size / divide
    half = layer_overhead_s(device) / 2
    if measured_batch_size and layer.measured_fwd_s is not None \
            and layer.measured_bwd_s is not None:
        g = samples / measured_batch_size / divide
        return tuple(half + max(0.0, t - half) * g
                     for t in (layer.measured_fwd_s, layer.measured_bwd_s))
    fused = fused_traffic_bytes(layer) if fuses_elementwise(device) else (math.inf, math.inf)
    pad = padded_expert_flops(layer)
    out = []
    for flops, mm, traffic, bound, extra in ((layer.flops_fwd, layer.matmul_flops_fwd,
                                              layer.memory_traffic_bytes_fwd, fused[0], pad[0]),
                                             (layer.flops_bwd, layer.matmul_flops_bwd,
                                              layer.memory_traffic_bytes_bwd, fused[1], pad[1])):
        traffic = min(traffic, bound)
        if not layer.has_op_classes:
            mm, traffic = flops, 0
        if extra:
            flops, mm = max(0.0, flops + extra), max(0.0, mm + extra)
        out.append(roofline_time_s(mm * f, (flops - mm) * f, traffic * f, device, precision)
                   + half)
    return out[0], out[1]


def layer_pass_time_s(layer: LayerProfile, samples: float, profile_batch_size: int,
                      device: DeviceSpec, precision: str, measured_batch_size: int = 0
                      ) -> float:
    """Forward + backward time of one layer for one pass over ``samples`` samples
    (``layer_fwd_bwd_time_s`` summed): roofline time + the layer overhead."""
    fwd, bwd = layer_fwd_bwd_time_s(layer, samples, profile_batch_size, device, precision,
                                    measured_batch_size=measured_batch_size)
    return fwd + bwd


def optimizer_time_s(param_bytes: float, grad_bytes: float, optimizer_bytes: float,
                     device: DeviceSpec) -> float:
    """Optimizer update, memory-bound: t = (2 W + G + 2 S) / B_mem.

    The update is element-wise (about one FLOP per byte moved, far below the
    roofline ridge point: Williams et al., "Roofline", CACM 2009), so its time is
    the bytes it moves over HBM: read and write the weights W, read the
    gradients G, read and write the optimizer state S, once per step.
    """
    return (2 * param_bytes + grad_bytes + 2 * optimizer_bytes) \
        / device.memory_bandwidth_bytes_per_s


def with_margin_bytes(raw_bytes: float) -> float:
    """Memory a device needs for ``raw_bytes`` of tensors: raw * MEMORY_MARGIN."""
    return raw_bytes * MEMORY_MARGIN


def saved_activation_bytes(layer: LayerProfile) -> int:
    """Bytes a layer keeps alive from its forward to its backward pass, for the profile
    batch: max(activation_saved_bytes, activation_bytes). The profiler's saved bytes
    (tensors the gradient ops read, e.g. attention scores) where it recorded them; at
    least the layer's output, which the next layer's backward reads."""
    return max(layer.activation_saved_bytes, layer.activation_bytes)


def layer_memory_bytes(layer: LayerProfile, samples_in_flight: float, profile_batch_size: int,
                       input_bytes: float = 0.0) -> float:
    """What holding one layer costs a device, margin included.

    M = (W + G + S + (A + I) * k / b) * MEMORY_MARGIN, with W, G, S the layer's
    weight, gradient and optimizer-state bytes, A its saved activation bytes
    (``saved_activation_bytes``) and
    I the bytes of model inputs it reads (for the profile batch b), and k the
    samples whose activations are alive at the peak. GPipe keeps every
    micro-batch's activations until its backward pass (Huang et al., "GPipe",
    NeurIPS 2019, Sec. 2.3), so k = the device's whole local batch.
    """
    activations = scaled(saved_activation_bytes(layer) + input_bytes, samples_in_flight,
                         profile_batch_size)
    return with_margin_bytes(layer.state_bytes + activations)


def gpipe_step_time_s(num_microbatches: int, num_stages: int, slowest_stage_s: float,
                      optimizer_s: float) -> float:
    """GPipe step: t = (m + p - 1) * t_stage + t_opt.

    m micro-batches through p stages: the slowest stage's forward+backward time
    per micro-batch t_stage (boundary transfers included) paces the pipeline,
    and fill and drain add p - 1 slots (Huang et al., "GPipe", NeurIPS 2019,
    bubble fraction (p-1)/(m+p-1)).
    """
    return (num_microbatches + num_stages - 1) * slowest_stage_s + optimizer_s


def model_tflops_per_device(flops_per_sample: float, global_batch: int, step_time_s: float,
                            devices_used: int) -> float:
    """Model FLOP/s per device in TFLOP/s: F_sample * B / t_step / d / 1e12
    (the "model FLOPs" of Chowdhery et al., PaLM, 2022, App. B: recomputation
    not counted)."""
    return flops_per_sample * global_batch / step_time_s / devices_used / 1e12


def exposed_allreduce_s(allreduce_s: float, overlappable_backward_s: float) -> float:
    """Exposed gradient all-reduce: max(0, t_allreduce - t_backward_overlappable).

    Assumption: gradients are all-reduced in buckets as they are produced during
    the backward pass (PyTorch DDP, Li et al., VLDB 2020, Sec. 3.2.3; TensorFlow's
    collective all-reduce of gradients as they are computed), so the all-reduce
    hides behind the backward compute of every layer but the first one.
    """
    return max(0.0, allreduce_s - overlappable_backward_s)


def pipeline_bubble_fraction(num_stages: int, num_microbatches: int,
                             virtual_stages: int = 1) -> float:
    """Bubble share of the pipeline time: (p-1)/(m+p-1) for GPipe and 1F1B alike; the
    interleaved schedule with v model chunks per device divides the bubble by v:
    ((p-1)/v)/(m+(p-1)/v) (Narayanan et al., SC'21, Sec. 2.2.1-2.2.2; p stages, m
    micro-batches)."""
    bubble = (num_stages - 1) / virtual_stages
    return bubble / (num_microbatches + bubble)


def pipeline_bubble_s(num_stages: int, stage_time_s: float, virtual_stages: int = 1) -> float:
    """Pipeline fill and drain: (p-1)/v x t_stage, t_stage the slowest device's time per
    micro-batch (all its chunks); v = 1 for GPipe and 1F1B (Narayanan et al., SC'21,
    Sec. 2.2.2: the interleaved schedule shrinks the bubble by the number of chunks v)."""
    return (num_stages - 1) / virtual_stages * stage_time_s


def batch_barrier_bubble_s(num_stages: int, stage_time_s: float, num_microbatches: int) -> float:
    """The bubble of a GPipe pipeline whose micro-batches meet at every BatchNormalization
    layer (global batch statistics, ``planner.batch_stats``): a stage cannot pass any
    micro-batch on before it has all of them, forward and backward, so the stages never
    overlap: step = pp x m x t_stage, the bubble m x (pp - 1) x t_stage (m times GPipe's,
    Huang et al., 2019)."""
    return num_microbatches * (num_stages - 1) * stage_time_s


def microbatches_in_flight(schedule: str, num_stages: int, num_microbatches: int,
                           virtual_stages: int = 1) -> float:
    """Micro-batches whose activations the first stage holds at its peak.

    GPipe: all m (Huang et al., NeurIPS 2019); 1F1B (PipeDream-Flush): min(p, m)
    (Narayanan et al., SC'21, Sec. 2.2.1); interleaved 1F1B with v chunks per device:
    min(p, m) x (1 + (p-1)/(p v)) (Korthikanti et al., "Reducing activation
    recomputation in large transformer models", 2022, Sec. 4.2.3: the warm-up runs
    further ahead); no pipeline ("none"): 1 -- gradient accumulation runs the m
    micro-batches one after another, each backward right after its forward.
    """
    if schedule == "1f1b":
        return min(num_stages, num_microbatches)
    if schedule == "interleaved":
        return min(num_stages, num_microbatches) * (
            1 + (num_stages - 1) / (num_stages * virtual_stages))
    if schedule == "none":
        return 1
    return num_microbatches


def hardware_tflops_per_device(hardware_flops_per_step: float, step_time_s: float,
                               devices_used: int) -> float:
    """Hardware FLOP/s per device in TFLOP/s, recomputation included (Chowdhery et al.,
    PaLM, 2022, App. B; Narayanan et al., SC'21, Eq. 3 counts it the same way)."""
    return hardware_flops_per_step / step_time_s / devices_used / 1e12


def with_shared_cores(breakdown: Breakdown, busy_s: Sequence[float], cluster: ClusterSpec
                      ) -> Breakdown:
    """A step on devices that share compute: every ``cluster.devices_per_compute_pool``
    consecutive devices (node-major) draw on one pool of cores -- logical CPU devices
    all share the host's -- so a step lasts at least the busy time of all the devices of
    a pool added up: t = max(t_step, max over pools of sum_d busy_d). ``busy_s``: each
    used device's compute, recomputation and optimizer time per step, in device order.
    The wait for the shared cores is added to ``compute_s``. Devices with their own
    compute (GPUs: pool 1) are unchanged.
    """
    pool = cluster.devices_per_compute_pool
    if pool <= 1 or len(busy_s) <= 1:
        return breakdown
    worst = max(sum(busy_s[i:i + pool]) for i in range(0, len(busy_s), pool))
    wait = worst - breakdown.total_s
    return replace(breakdown, compute_s=breakdown.compute_s + wait) if wait > 0 else breakdown


def with_step_overhead(breakdown: Breakdown, overhead_s: float) -> Breakdown:
    """Add the framework's per-step overhead (``ModelProfile.measured_step_overhead_s``:
    host dispatch and batch feeding, measured on one device) once per step."""
    return replace(breakdown, overhead_s=breakdown.overhead_s + overhead_s) \
        if overhead_s else breakdown
