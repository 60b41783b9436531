"""planner.cost_model: each formula against a hand computation."""
from __future__ import annotations

import pytest

from tfplan.planner import collectives as coll
from tfplan.planner import cost_model as cm
from tfplan.core.cluster import DeviceSpec, LinkSpec
from tfplan.core.presets import parse_cluster
from tfplan.profiler.model_profile import LayerProfile

DEVICE = DeviceSpec(kind="Test", device_type="GPU", memory_bytes=2**30,
                    peak_flops_per_s=(("float16", 200e12), ("float32", 20e12)),
                    memory_bandwidth_bytes_per_s=1e12, matmul_efficiency=0.5)
LINK = LinkSpec(bandwidth_bytes_per_s=100e9, latency_s=1e-5)
LAYER = LayerProfile(name="d", type="Dense", params=1000, trainable_params=1000,
                     param_bytes=4000, grad_bytes=4000, optimizer_bytes=8000,
                     activation_bytes=2048, flops_fwd=6_000_000, flops_bwd=12_000_000)


def test_compute_time_is_flops_over_achieved_peak():
    assert cm.compute_time_s(1e12, DEVICE, "float32") == pytest.approx(1e12 / (20e12 * 0.5))
    assert cm.compute_time_s(1e12, DEVICE, "mixed_float16") == pytest.approx(1e12 / 100e12)
    a100 = parse_cluster("8xA100-80GB").device
    assert cm.compute_time_s(312e12, a100, "mixed_bfloat16") == pytest.approx(1 / 0.6)


def test_layer_pass_scales_with_samples_and_adds_the_fixed_overhead():
    # profile batch 8, 32 samples: (6e6 + 12e6) * 32/8 = 72e6 FLOPs at 10 TFLOP/s achieved
    t = cm.layer_pass_time_s(LAYER, 32, 8, DEVICE, "float32")
    assert t == pytest.approx(72e6 / 10e12 + 10e-6)
    assert cm.LAYER_OVERHEAD_S == 10e-6
    # four micro-batches of 8 cost more than one batch of 32: the overhead is per pass
    assert 4 * cm.layer_pass_time_s(LAYER, 8, 8, DEVICE, "float32") > t


def test_ring_allreduce():
    assert coll.ring_allreduce_time_s(1e9, 1, LINK) == 0.0
    # 2 (n-1)/n N / beta + 2 (n-1) alpha, n = 4
    assert coll.ring_allreduce_time_s(1e9, 4, LINK) == pytest.approx(1.5 * 1e9 / 100e9 + 6e-5)
    assert coll.ring_allreduce_time_s(0, 2, LINK) == pytest.approx(2e-5)


def test_p2p_is_latency_plus_bytes_over_bandwidth():
    assert coll.p2p_time_s(1e6, LINK) == pytest.approx(1e-5 + 1e-5)
    assert coll.p2p_time_s(0, LINK) == 1e-5


def test_optimizer_moves_weights_grads_and_state_over_hbm():
    # read+write W, read G, read+write S
    assert cm.optimizer_time_s(4000, 4000, 8000, DEVICE) == pytest.approx(
        (8000 + 4000 + 16000) / 1e12)


def test_layer_memory_counts_state_and_activations_of_samples_in_flight():
    assert cm.MEMORY_MARGIN == 1.10
    # state 16000 + (2048 activation + 512 input) * 32/8, times the margin
    assert cm.layer_memory_bytes(LAYER, 32, 8, input_bytes=512) == pytest.approx(
        (16000 + 2560 * 4) * 1.10)
    assert cm.with_margin_bytes(1000) == pytest.approx(1100)
    assert cm.scaled(2048, 4, 8) == 1024


def test_gpipe_step_and_model_tflops():
    assert cm.gpipe_step_time_s(8, 4, 0.01, 0.002) == pytest.approx(11 * 0.01 + 0.002)
    assert cm.model_tflops_per_device(3e12, 64, 2.0, 8) == pytest.approx(3e12 * 64 / 2 / 8 / 1e12)


def test_hierarchical_allreduce_by_hand():
    # 4 nodes x 8 devices, 1 GB: reduce-scatter and all-gather in the node over NVLink
    # (each 7/8 * N / 100 GB/s + 7 alpha), then a ring all-reduce of N/8 over 4 nodes
    # (2 * 3/4 * N/8 / 25 GB/s + 6 alpha)
    intra, inter = LinkSpec(100e9, 1e-5), LinkSpec(25e9, 5e-6)
    n = 1e9
    by_hand = 2 * (7 / 8 * n / 100e9 + 7 * 1e-5) + (2 * 3 / 4 * (n / 8) / 25e9 + 6 * 5e-6)
    assert coll.hierarchical_allreduce_time_s(n, 8, 4, intra, inter) == pytest.approx(by_hand)
    # one node: the plain ring
    assert coll.hierarchical_allreduce_time_s(n, 8, 1, intra, inter) == pytest.approx(
        coll.ring_allreduce_time_s(n, 8, intra))
    # it beats a flat ring over the network for 32 devices
    assert coll.hierarchical_allreduce_time_s(n, 8, 4, intra, inter) < \
        coll.ring_allreduce_time_s(n, 32, inter)


def test_allgather_reduce_scatter_sum_to_the_ring_allreduce():
    n, link = 4e8, LinkSpec(50e9, 2e-6)
    assert coll.ring_allgather_time_s(n, 1, link) == 0
    assert coll.ring_allgather_time_s(n, 4, link) == pytest.approx(3 / 4 * n / 50e9 + 3 * 2e-6)
    assert coll.ring_reduce_scatter_time_s(n, 4, link) + coll.ring_allgather_time_s(n, 4, link) \
        == pytest.approx(coll.ring_allreduce_time_s(n, 4, link))


def test_overlap_bubble_and_microbatches_in_flight():
    assert cm.exposed_allreduce_s(3.0, 2.0) == 1.0 and cm.exposed_allreduce_s(1.0, 2.0) == 0
    assert cm.pipeline_bubble_fraction(4, 12) == pytest.approx(3 / 15)
    assert cm.microbatches_in_flight("gpipe", 4, 12) == 12
    assert cm.microbatches_in_flight("1f1b", 4, 12) == 4
    assert cm.microbatches_in_flight("1f1b", 4, 2) == 2


# --- roofline by op class -----------------------------------------------------------------

SPLIT = LayerProfile(name="n", type="LayerNormalization", params=0, trainable_params=0,
                     param_bytes=0, grad_bytes=0, optimizer_bytes=0, activation_bytes=1000,
                     flops_fwd=5_000_000, flops_bwd=9_000_000, input_bytes=1000,
                     activation_saved_bytes=500, matmul_flops_fwd=4_000_000,
                     matmul_flops_bwd=8_000_000, memory_traffic_bytes_fwd=10**8,
                     memory_traffic_bytes_bwd=3 * 10**8)
CPU = DeviceSpec(kind="CPU", device_type="CPU", memory_bytes=2**30,
                 peak_flops_per_s=(("float32", 100e9),), memory_bandwidth_bytes_per_s=10e9,
                 matmul_efficiency=1.0, layer_overhead_s=40e-6)


def test_roofline_prices_contractions_by_flops_and_the_rest_by_traffic():
    # 1e9 contraction FLOPs at 10 TFLOP/s achieved + max(1e6 / 20e12, 1e9 B / 1 TB/s)
    t = cm.roofline_time_s(1e9, 1e6, 1e9, DEVICE, "float32")
    assert t == pytest.approx(1e9 / 10e12 + 1e9 / 1e12)
    # compute-bound other ops (no traffic): their FLOPs at the plain float32 rate
    assert cm.roofline_time_s(0, 1e9, 0, DEVICE, "mixed_float16") == pytest.approx(1e9 / 20e12)


def test_a_cpu_runs_every_op_unfused_with_its_measured_overhead():
    fwd, bwd = cm.layer_fwd_bwd_time_s(SPLIT, 2, 1, CPU, "float32")
    # 2 samples: 8e6 contraction FLOPs at 100 GFLOP/s + 2e8 B at 10 GB/s + half of 40 us
    assert fwd == pytest.approx(8e6 / 100e9 + 2e8 / 10e9 + 20e-6)
    assert bwd == pytest.approx(16e6 / 100e9 + 6e8 / 10e9 + 20e-6)


def test_a_gpu_fuses_element_wise_ops_so_only_inputs_outputs_and_saved_move():
    fwd, bwd = cm.layer_fwd_bwd_time_s(SPLIT, 1, 1, DEVICE, "float32")
    once = 1000 + 1000 + 500  # inputs + outputs + saved, far below the unfused 1e8
    assert fwd == pytest.approx(4e6 / 10e12 + max(1e6 / 20e12, once / 1e12) + 5e-6)
    assert bwd == pytest.approx(8e6 / 10e12 + max(1e6 / 20e12, 2 * once / 1e12) + 5e-6)
    # a tensor-parallel split divides all of it but the overhead
    fwd4, _ = cm.layer_fwd_bwd_time_s(SPLIT, 1, 1, DEVICE, "float32", divide=4)
    assert fwd4 - 5e-6 == pytest.approx((fwd - 5e-6) / 4)


def test_profiles_without_the_op_classes_price_every_flop_as_a_contraction():
    assert not LAYER.has_op_classes and SPLIT.has_op_classes
    fwd, bwd = cm.layer_fwd_bwd_time_s(LAYER, 8, 8, DEVICE, "float32")
    assert (fwd, bwd) == pytest.approx((6e6 / 10e12 + 5e-6, 12e6 / 10e12 + 5e-6))


def test_interleaving_divides_the_bubble_and_grows_the_warm_up():
    assert cm.pipeline_bubble_s(4, 1.0) == pytest.approx(3.0)
    assert cm.pipeline_bubble_s(4, 1.0, virtual_stages=3) == pytest.approx(1.0)
    assert cm.pipeline_bubble_fraction(4, 12, 3) == pytest.approx(1 / 13)
    # Korthikanti et al. 2022: min(p, m) x (1 + (p-1)/(p v))
    assert cm.microbatches_in_flight("interleaved", 4, 12, 2) == pytest.approx(4 * (1 + 3 / 8))
    assert cm.microbatches_in_flight("none", 1, 8) == 1  # gradient accumulation: one at a time


def test_pipeline_send_scatters_over_tensor_ranks_then_gathers():
    intra = LinkSpec(bandwidth_bytes_per_s=300e9, latency_s=0.0)
    assert coll.pipeline_send_time_s(8e9, 1, LINK, intra) == pytest.approx(1e-5 + 8e9 / 100e9)
    # tp = 8: 1 GB per rank over its own link + ring all-gather of 8 GB over 8 ranks
    assert coll.pipeline_send_time_s(8e9, 8, LINK, intra) == pytest.approx(
        1e-5 + 1e9 / 100e9 + 7 / 8 * 8e9 / 300e9)


def test_devices_sharing_a_pool_of_cores_wait_for_each_other():
    from tfplan.planner.plan import Breakdown
    cpu4 = parse_cluster("cpu:4")
    assert cpu4.devices_per_compute_pool == 4
    b = Breakdown(compute_s=1.0, communication_s=0.5, bubble_s=0.0, recompute_s=0.0,
                  optimizer_s=0.1)
    # four devices each busy 1.1 s share the cores: 4.4 s of work, the step lasts 4.4 s
    shared = cm.with_shared_cores(b, [1.1] * 4, cpu4)
    assert shared.total_s == pytest.approx(4.4)
    assert shared.compute_s == pytest.approx(1.0 + 4.4 - 1.6)
    assert cm.with_shared_cores(b, [0.2] * 4, cpu4) == b  # less work than the step: as is
    gpus = parse_cluster("8xA100-80GB")  # each GPU its own compute
    assert cm.with_shared_cores(b, [1.1] * 8, gpus) == b


def test_on_logical_cpus_data_parallel_is_no_faster_than_the_work_it_shares():
    from tfplan.planner.search import search
    from tests.planner.test_search import chain_profile
    profile = chain_profile()
    result = search(profile, parse_cluster("cpu:4"), 64)
    single = next(p for p in result.candidates if p.name == "single device")
    dp4 = next(p for p in result.candidates if p.name == "data parallel dp=4")
    assert dp4.predicted.step_time_s >= single.predicted.step_time_s * (1 - 1e-9)
