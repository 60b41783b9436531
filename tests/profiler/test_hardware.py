"""profiler.hardware: quick hardware profiles on logical CPU devices, the alpha-beta fit,
the layer overhead, JSON round trip, the ClusterSpec it makes (its collective and
point-to-point links; planner.search accepts it), bad devices.

Timings on logical CPU devices are noise-prone (two cores, one shared thread
pool), so measured numbers are checked for sign, shape and self-consistency
only; exact arithmetic is checked on synthetic points.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from tfplan.planner import collectives as cm
from tfplan.core.cluster import ClusterSpec
from tfplan.core.errors import ClusterSpecError, PlannerError, SchemaError
from tfplan.planner.search import search
from tfplan.planner.validate import validate_plan
from tfplan.profiler.hardware import (devices_from_arg, profile_hardware, resolve_devices,
                               run_profile_hardware, summary_rows, to_cluster_spec)
from tfplan.profiler.hw_profile import (AllReduceResult, AlphaBetaFit, CommPoint, HardwareProfile,
                                 LayerOverhead, MatmulPoint, MatmulResult, MemoryBandwidth,
                                 P2PResult, fit_alpha_beta)
from tfplan.profiler.model_profile import Edge, LayerProfile, ModelProfile

CPU4 = tuple(f"/device:CPU:{i}" for i in range(4))


@pytest.fixture(scope="module")
def quick4():
    """A quick profile of four logical CPUs (float32 only), with its progress calls."""
    calls = []
    hw = profile_hardware(["CPU:0", "cpu:1", "/device:CPU:2",
                           "/job:localhost/replica:0/task:0/device:CPU:3"],
                          precisions=("float32",), quick=True,
                          progress=lambda stage, done, total: calls.append((stage, done, total)))
    return hw, calls


@pytest.fixture(scope="module")
def quick2():
    """What `plan profile-hardware --devices CPU:0,CPU:1 --quick` computes."""
    return run_profile_hardware(["CPU:0", "CPU:1"], True, None)


# --- measured profiles ------------------------------------------------------------------
def test_quick_profile_measures_every_part(quick4):
    hw, calls = quick4
    assert hw.device_type == "CPU" and hw.devices == CPU4 and hw.quick
    assert [m.precision for m in hw.matmul] == ["float32"]
    points = hw.matmul[0].points
    assert [p.n for p in points] == [64, 128, 256]
    assert all(p.seconds > 0 and p.flops_per_s > 0 for p in points)
    assert hw.matmul[0].best_flops_per_s == max(p.flops_per_s for p in points)
    assert points[0].flops_per_s == pytest.approx(2 * 64**3 / points[0].seconds)
    assert hw.memory_bandwidth.bandwidth_bytes_per_s > 0
    assert hw.memory_bandwidth.bytes_moved == 3 * hw.memory_bandwidth.buffer_bytes
    assert [(p.src, p.dst) for p in hw.p2p] == [(CPU4[0], CPU4[1])]  # quick: one pair
    assert hw.allreduce is not None and hw.allreduce.devices == CPU4
    assert hw.allreduce.implementation == "CollectiveReduceV2/ring"
    sizes = [p.nbytes for p in hw.allreduce.points]
    assert sizes == sorted(sizes) and len(set(sizes)) == 4
    assert hw.memory_bytes_per_device > 0 and "// 4" in hw.memory_source
    assert any("share one thread pool" in n for n in hw.notes)
    stages = [c[0] for c in calls]
    assert stages[0] == "matmul:float32" and "memory" in stages
    assert stages.index("layer overhead") == stages.index("memory") + 2  # (m, 0/1), (m, 1/1)
    assert "p2p:CPU:0->CPU:1" in stages and stages[-1] == "allreduce"
    assert calls[-1] == ("allreduce", 4, 4)


def test_layer_overhead_is_measured_on_the_first_device(quick4):
    hw = quick4[0]
    o = hw.layer_overhead
    assert (o.batch, o.width, o.flops) == (8, 32, 6 * 8 * 32**2)
    assert o.flops_per_s == hw.matmul[0].best_flops_per_s  # priced at the float32 rate
    assert o.method == "difference" and o.seconds > 0
    # a tiny layer is all overhead: its 49 kFLOP take ~1 us at tens of GFLOP/s, while
    # TensorFlow dispatches ~8 ops for it (a few us each on a CPU)
    assert o.flop_time_s < 0.5 * o.seconds and o.overhead_s == o.seconds - o.flop_time_s
    assert 1e-6 < o.overhead_s < 2e-3


def test_layer_overhead_arithmetic():
    o = LayerOverhead(batch=4, width=10, seconds=30e-6, flops_per_s=1e9)
    assert o.flops == 2400 and o.flop_time_s == pytest.approx(2.4e-6)
    assert o.overhead_s == pytest.approx(27.6e-6)
    # a measured time below the FLOP time (noise) leaves no negative overhead
    assert LayerOverhead(batch=4, width=10, seconds=1e-6, flops_per_s=1e9).overhead_s == 0.0


def _relative_errors(fit, points) -> list[float]:
    return [abs(fit.predict_s(p.nbytes) - p.seconds) / p.seconds for p in points]


def test_allreduce_fit_reproduces_the_measurements(quick4):
    ar = quick4[0].allreduce
    fit = ar.fit
    assert fit.latency_s >= 0 and fit.bandwidth_bytes_per_s is not None
    # bytes really move in TensorFlow's CPU ring, so time grows with the size
    assert ar.points[-1].seconds > ar.points[0].seconds
    errors = _relative_errors(fit, ar.points)
    assert fit.max_relative_error == pytest.approx(max(errors))
    # a busy host can spoil one point; the fit (relative residuals) must follow the rest
    assert np.median(errors) < 0.35 and max(errors) < 1.5
    assert ar.bus_factor == 1.5  # 2 (n-1) / n for n = 4
    assert ar.bus_bandwidth_bytes_per_s == pytest.approx(1.5 * fit.bandwidth_bytes_per_s)


def test_p2p_fit_reproduces_the_measurements(quick4):
    (p2p,) = quick4[0].p2p
    assert all(p.seconds > 0 for p in p2p.points)
    # logical CPUs hand over a buffer: microseconds whatever the size, so a near-flat line
    misses = [abs(p2p.fit.predict_s(p.nbytes) - p.seconds) for p in p2p.points]
    assert np.median(misses) <= max(0.5 * np.median([p.seconds for p in p2p.points]), 20e-6)
    assert p2p.fit.max_relative_error == pytest.approx(max(_relative_errors(p2p.fit,
                                                                            p2p.points)))


@pytest.mark.parametrize("n", [2, 4])
def test_tensorflow_allreduce_sums(n):
    from tfplan.profiler.hw_comm import allreduce_once

    rng = np.random.default_rng(n)
    values = [rng.standard_normal(1000).astype(np.float32) for _ in range(n)]
    results = allreduce_once(CPU4[:n], values, "ring")
    assert len(results) == n
    for r in results:
        np.testing.assert_allclose(r, np.sum(values, axis=0), rtol=1e-5, atol=1e-5)


def test_run_profile_hardware_returns_a_cluster_for_two_devices(quick2):
    hw, cluster = quick2
    assert hw.devices == CPU4[:2]
    assert [m.precision for m in hw.matmul] == ["float32", "float16", "bfloat16"]
    assert cluster == to_cluster_spec(hw)
    assert cluster.devices_per_node == 2 and cluster.num_nodes == 1
    assert cluster.device.device_type == "CPU"
    assert dict(cluster.device.peak_flops_per_s) == dict(hw.best_flops_per_s())
    rows = summary_rows(hw, cluster)
    assert rows[0][0] == "devices" and rows[-1][0] == "cluster link"
    names = [r[0] for r in rows]
    assert names[-3:-1] == ["layer overhead", "cluster p2p link"]
    assert rows[names.index("layer overhead")][1] == \
        f"{hw.layer_overhead.overhead_s * 1e6:.3g} us"
    assert cluster.device.layer_overhead_s == hw.layer_overhead.overhead_s
    assert [r[0] for r in rows if r[0].startswith("matmul")] == [
        "matmul float32", "matmul float16", "matmul bfloat16"]
    assert all(isinstance(c, str) for r in rows for c in r)


# --- JSON -------------------------------------------------------------------------------
def test_json_round_trip(quick4):
    hw = quick4[0]
    text = json.dumps(hw.to_dict())
    assert HardwareProfile.from_dict(json.loads(text)) == hw
    doc = json.loads(text)
    assert doc["schema_version"] == 1
    assert doc["matmul"][0]["best_flops_per_s"] == hw.matmul[0].best_flops_per_s
    assert doc["allreduce"]["bus_bandwidth_bytes_per_s"] == hw.allreduce.bus_bandwidth_bytes_per_s
    assert doc["layer_overhead"]["overhead_s"] == hw.layer_overhead.overhead_s


def test_json_round_trip_of_a_synthetic_profile_and_bad_documents():
    hw = synthetic_profile(2)
    assert HardwareProfile.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw
    flat = synthetic_profile(2, p2p_bandwidth=None)
    assert flat.to_dict()["p2p"][0]["fit"]["bandwidth_bytes_per_s"] is None
    assert HardwareProfile.from_dict(json.loads(json.dumps(flat.to_dict()))) == flat
    with pytest.raises(SchemaError, match="schema_version"):
        HardwareProfile.from_dict({**hw.to_dict(), "schema_version": 99})
    bad = hw.to_dict()
    bad["matmul"][0]["points"][0]["seconds"] = 0
    with pytest.raises(SchemaError, match=r"matmul\[0\].points\[0\].seconds is 0"):
        HardwareProfile.from_dict(bad)
    bad = hw.to_dict()
    bad["layer_overhead"]["flops_per_s"] = -1
    with pytest.raises(SchemaError, match="layer_overhead.flops_per_s is -1.0.*FLOP/s"):
        HardwareProfile.from_dict(bad)


def test_a_profile_saved_before_the_layer_overhead_still_loads():
    doc = synthetic_profile(2).to_dict()
    del doc["layer_overhead"]
    old = HardwareProfile.from_dict(doc)
    assert old.layer_overhead is None
    assert to_cluster_spec(old).device.layer_overhead_s is None
    assert "layer overhead" not in [r[0] for r in summary_rows(old, to_cluster_spec(old))]


# --- ClusterSpec ------------------------------------------------------------------------
def test_cluster_spec_from_a_measured_profile(quick4):
    hw = quick4[0]
    cluster = to_cluster_spec(hw, name="here")
    assert isinstance(cluster, ClusterSpec) and cluster.name == "here"
    assert cluster.devices_per_node == 4 and cluster.num_devices == 4
    assert cluster.devices_per_compute_pool == 4  # logical CPUs share the host's cores
    d = cluster.device
    assert d.matmul_efficiency == 1.0 and "ACHIEVED" in d.source and "not a datasheet" in d.source
    assert d.achieved_flops("float32") == hw.matmul[0].best_flops_per_s
    assert d.memory_bandwidth_bytes_per_s == hw.memory_bandwidth.bandwidth_bytes_per_s
    assert d.memory_bytes == hw.memory_bytes_per_device
    assert ClusterSpec.from_dict(json.loads(json.dumps(cluster.to_dict()))) == cluster
    # the ring formula with the derived link gives back the measured all-reduce fit
    fit = hw.allreduce.fit
    for nbytes in (4096, 2**20, 2**26):
        assert cm.ring_allreduce_time_s(nbytes, 4, cluster.intra_node_link) == pytest.approx(
            fit.predict_s(nbytes), rel=1e-9)
    assert "busbw = algbw x 2(n-1)/n" in cluster.intra_node_link.source
    # stage transfers get the measured copy, not the all-reduce: on logical CPUs a
    # hand-over costs microseconds, a 4-device ring all-reduce a millisecond
    p2p = cluster.p2p_link(same_node=True)
    assert p2p == cluster.intra_node_p2p_link and "point-to-point" in p2p.source
    assert p2p.latency_s == hw.p2p[0].fit.latency_s
    assert cm.p2p_time_s(4096, p2p) < 0.2 * cm.ring_allreduce_time_s(4096, 4,
                                                                      cluster.intra_node_link)
    assert d.layer_overhead_s == hw.layer_overhead.overhead_s and "layer_overhead_s" in d.source


def test_planner_search_accepts_the_measured_cluster(quick4):
    cluster = to_cluster_spec(quick4[0])
    profile = tiny_profile()
    result = search(profile, cluster, 16)
    for plan in result.candidates:
        validate_plan(plan, profile)
    assert result.chosen.predicted.fits
    assert result.chosen.devices[0].startswith("/device:CPU:")
    names = {p.name for p in result.candidates}
    assert "single device" in names and "data parallel dp=4" in names


def test_allreduce_link_inverts_the_bus_bandwidth_convention():
    for n in (2, 4, 8):
        hw = synthetic_profile(n, allreduce_latency_s=60e-6, algbw=10e9)
        link = to_cluster_spec(hw).intra_node_link
        assert link.bandwidth_bytes_per_s == pytest.approx(10e9 * 2 * (n - 1) / n)
        assert link.latency_s == pytest.approx(60e-6 / (2 * (n - 1)))
        for nbytes in (1e3, 1e6, 1e9):
            assert cm.ring_allreduce_time_s(nbytes, n, link) == pytest.approx(
                60e-6 + nbytes / 10e9)


def test_link_from_p2p_takes_the_slowest_pair_and_falls_back():
    hw = synthetic_profile(3, p2p_bandwidth=5e9)
    link = to_cluster_spec(hw, link_from="p2p").intra_node_link
    assert link.bandwidth_bytes_per_s == pytest.approx(5e9 / 2)  # the second pair is slower
    assert link.latency_s == pytest.approx(2 * 7e-6)
    assert "point-to-point" in link.source
    no_bw = synthetic_profile(3, p2p_bandwidth=None)  # CPU-like: no bytes moved
    assert "all-reduce" in to_cluster_spec(no_bw, link_from="p2p").intra_node_link.source
    with pytest.raises(ClusterSpecError, match="link_from is 'nvlink'"):
        to_cluster_spec(hw, link_from="nvlink")


def test_p2p_link_is_the_slowest_measured_pair():
    hw = synthetic_profile(3, p2p_bandwidth=5e9)  # pairs at 5 and 2.5 GB/s, 7 and 14 us
    cluster = to_cluster_spec(hw)
    p2p = cluster.intra_node_p2p_link
    assert p2p.bandwidth_bytes_per_s == pytest.approx(2.5e9)
    assert p2p.latency_s == pytest.approx(14e-6)
    assert cluster.p2p_link(True) == p2p and "all-reduce" in cluster.intra_node_link.source
    assert cluster.devices_per_compute_pool == 1  # GPUs compute on their own
    assert cm.p2p_time_s(2**24, p2p) == pytest.approx(hw.p2p[1].points[-1].seconds)


def test_p2p_link_without_a_fitted_bandwidth_takes_the_lower_bound_of_the_points():
    # CPU-like: the time does not grow with the size; the largest message, 16 MiB in
    # 14 us on the slower pair, shows the bandwidth is at least 2**24 / 14e-6
    hw = synthetic_profile(3, p2p_bandwidth=None)
    p2p = to_cluster_spec(hw).intra_node_p2p_link
    assert p2p.bandwidth_bytes_per_s == pytest.approx(2**24 / 14e-6)
    assert p2p.latency_s == pytest.approx(14e-6)
    assert "bounded below by max(N / t)" in p2p.source
    for result in hw.p2p:  # t = alpha + N / beta >= every measured time
        for point in result.points:
            assert cm.p2p_time_s(point.nbytes, p2p) >= point.seconds


def test_one_device_gets_a_placeholder_link():
    hw = synthetic_profile(1)
    cluster = to_cluster_spec(hw)
    assert cluster.devices_per_node == 1
    assert "placeholder" in cluster.intra_node_link.source
    assert cluster.intra_node_link.latency_s == 0.0
    assert cluster.intra_node_p2p_link is None


# --- the alpha-beta fit -------------------------------------------------------------------
def test_fit_recovers_an_exact_line():
    pts = [CommPoint(n, 20e-6 + n / 3e9) for n in (4096, 65536, 2**20, 2**24)]
    fit = fit_alpha_beta(pts)
    assert fit.latency_s == pytest.approx(20e-6, rel=1e-6)
    assert fit.bandwidth_bytes_per_s == pytest.approx(3e9, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0) and fit.max_relative_error < 1e-6


def test_fit_keeps_alpha_and_beta_non_negative():
    flat = fit_alpha_beta([CommPoint(n, 5e-6) for n in (10, 1000, 10**6)])
    assert flat.bandwidth_bytes_per_s is None and flat.latency_s == pytest.approx(5e-6)
    assert flat.predict_s(10**9) == pytest.approx(5e-6)
    # data that would want a negative intercept gets alpha = 0
    steep = fit_alpha_beta([CommPoint(1000, 1e-9), CommPoint(10**6, 1e-3), CommPoint(10**7, 1e-2)])
    assert steep.latency_s == 0.0 and steep.bandwidth_bytes_per_s > 0
    with pytest.raises(ValueError, match="at least two message sizes"):
        fit_alpha_beta([CommPoint(64, 1e-6), CommPoint(64, 2e-6)])


# --- bad input ----------------------------------------------------------------------------
@pytest.mark.parametrize("devices, match", [
    (["GPU:0"], r"\['/device:GPU:0'\] do not exist"),
    (["CPU:0", "CPU:99"], r"\['/device:CPU:99'\] do not exist"),
    (["banana"], "'banana' is not a device name"),
    ([], "No devices given"),
])
def test_bad_device_names_list_the_devices_that_exist(devices, match):
    with pytest.raises(PlannerError, match=match) as e:
        profile_hardware(devices, quick=True)
    assert "/device:CPU:0" in str(e.value) and "/device:CPU:7" in str(e.value)


def test_repeated_or_mixed_devices_and_bad_arguments():
    with pytest.raises(PlannerError, match="named more than once"):
        resolve_devices(["CPU:1", "/device:CPU:1"])
    with pytest.raises(PlannerError, match="mix types"):
        resolve_devices(["CPU:0", "GPU:0"])
    with pytest.raises(PlannerError, match=r"precision\(s\) \['tf32'\]"):
        profile_hardware(["CPU:0"], precisions=("tf32",), quick=True)
    with pytest.raises(PlannerError, match="at least two different message sizes"):
        profile_hardware(["CPU:0", "CPU:1"], comm_sizes_bytes=(1024,), quick=True)
    with pytest.raises(PlannerError, match="positive whole numbers"):
        profile_hardware(["CPU:0"], matmul_sizes=(0,), quick=True)
    with pytest.raises(PlannerError, match="memory_buffer_bytes is 1.5"):
        profile_hardware(["CPU:0"], memory_buffer_bytes=1.5, quick=True)


def test_devices_argument_of_the_cli():
    assert devices_from_arg("cpu:3") == ["CPU:0", "CPU:1", "CPU:2"]  # as --cluster cpu:3
    assert devices_from_arg("GPU:0, GPU:1") == ["GPU:0", "GPU:1"]
    assert devices_from_arg("CPU:1,CPU:2") == ["CPU:1", "CPU:2"]
    assert devices_from_arg(None) is None and devices_from_arg(" ") is None
    with pytest.raises(PlannerError, match="cpu:N with N >= 1"):
        devices_from_arg("cpu:0")


def test_default_devices_are_all_logical_cpus_here():
    assert resolve_devices(None) == tuple(f"/device:CPU:{i}" for i in range(8))


# --- helpers ------------------------------------------------------------------------------
def synthetic_profile(n: int, allreduce_latency_s: float = 100e-6, algbw: float = 2e9,
                      p2p_bandwidth: float | None = 5e9) -> HardwareProfile:
    """A hand-made profile of n devices: exact alpha-beta points, no TensorFlow."""
    devices = tuple(f"/device:GPU:{i}" for i in range(n))
    sizes = (4096, 2**20, 2**24)

    def line(alpha: float, beta: float | None, scale: float = 1.0):
        pts = tuple(CommPoint(s, alpha + (0 if beta is None else s / beta)) for s in sizes)
        fit = fit_alpha_beta(pts) if beta is not None else AlphaBetaFit(alpha, None, 0.0, 0.0)
        return pts, fit

    p2p = []
    for j, dst in enumerate(devices[1:], start=1):
        bw = None if p2p_bandwidth is None else p2p_bandwidth / j
        pts, fit = line(7e-6 * j, bw)
        p2p.append(P2PResult(devices[0], dst, pts, fit))
    allreduce = None
    if n > 1:
        pts, fit = line(allreduce_latency_s, algbw)
        allreduce = AllReduceResult(devices, "CollectiveReduceV2/nccl", pts, fit)
    return HardwareProfile(
        device_type="GPU", device_kind="TestGPU", devices=devices,
        memory_bytes_per_device=16 * 2**30, memory_source="test",
        matmul=(MatmulResult("float32", (MatmulPoint(1024, 1e-3), MatmulPoint(2048, 5e-3))),
                MatmulResult("bfloat16", (MatmulPoint(2048, 1e-3),))),
        memory_bandwidth=MemoryBandwidth(2**30, 3e-3), p2p=tuple(p2p), allreduce=allreduce,
        layer_overhead=LayerOverhead(batch=8, width=32, seconds=20e-6, flops_per_s=1e12),
        tensorflow_version="2.21.0", notes=("synthetic",))


def tiny_profile() -> ModelProfile:
    """Four Dense-like layers of 1e5 parameters (Adam), batch 8."""
    layers, edges = [], [Edge("input_1", "d0", 4096)]
    for i in range(4):
        layers.append(LayerProfile(
            name=f"d{i}", type="Dense", params=100_000, trainable_params=100_000,
            param_bytes=400_000, grad_bytes=400_000, optimizer_bytes=800_000,
            activation_bytes=4096, flops_fwd=1_600_000, flops_bwd=3_200_000,
            inputs=(f"d{i - 1}",) if i else ("input_1",)))
        if i:
            edges.append(Edge(f"d{i - 1}", f"d{i}", 4096))
    return ModelProfile(model_name="tiny", batch_size=8, precision="float32", optimizer="adam",
                        optimizer_slots_per_param=2, layers=tuple(layers), edges=tuple(edges))
