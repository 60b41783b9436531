"""From a measured ``HardwareProfile`` to the ``ClusterSpec`` the planner reads, and display rows.

Pipeline position: between ``profiler.hardware.profile_hardware`` (which
measures) and the planner (``planner.search`` prices strategies with the
ClusterSpec); ``plan profile-hardware`` prints ``summary_rows``. Pure: imports
no TensorFlow, so a saved profile converts on any machine.
"""
from __future__ import annotations

from tfplan.core.cluster import ClusterSpec, DeviceSpec, LinkSpec
from tfplan.core.errors import ClusterSpecError
from tfplan.profiler.hw_profile import AlphaBetaFit, CommPoint, HardwareProfile

LINK_SOURCES = ("allreduce", "p2p")
KiB, MiB = 2**10, 2**20


def to_cluster_spec(hw: HardwareProfile, name: str | None = None,
                    link_from: str = "allreduce") -> ClusterSpec:
    """A one-node ClusterSpec with the measured figures (pure: no TensorFlow).

    peak_flops_per_s holds the best *achieved* matmul FLOP/s per precision, so
    matmul_efficiency is 1.0 (the measurement already includes it).
    ``layer_overhead_s`` is the measured fixed cost of a layer's forward and
    backward ops beyond their FLOPs (``LayerOverhead.overhead_s``), when measured.

    Two links. The cost model prices the data-parallel gradient all-reduce
    (``ring_allreduce_time_s``: 2(n-1)/n N / beta + 2(n-1) alpha) with the
    collective link ``intra_node_link``, and pipeline stage-boundary transfers
    (``p2p_time_s``: alpha + N / beta) with ``ClusterSpec.p2p_link``, which is
    ``intra_node_p2p_link`` when set. On logical CPU devices the two differ by
    two orders of magnitude: a ring all-reduce step costs ~100 us, a hand-over
    between devices ~5 us.

    ``intra_node_link``: ``link_from="allreduce"`` (default) takes it from the
    measured all-reduce: beta = the fitted bus bandwidth (algbw x 2(n-1)/n,
    nccl-tests' busbw) and alpha = the fitted latency / 2(n-1), so the ring
    formula reproduces the measured all-reduce exactly. ``link_from="p2p"``
    takes the slowest measured pair instead (the lowest bandwidth, the highest
    latency). When the chosen measurement has no bandwidth, the other one is
    used; with neither (or one device), the link is a placeholder at memory
    bandwidth, which the cost model never uses for one device.

    ``intra_node_p2p_link``: the slowest measured pair (``_p2p_link``); when no
    pair's time grew with the size (logical CPUs hand a buffer over without
    copying it), its bandwidth is the lower bound the points allow, max(N / t)
    (any t = alpha + N / beta >= N / beta). None with one device.

    ``devices_per_compute_pool``: all n for CPU devices (logical CPU devices share
    the host's cores; the rates above were measured on one with the others
    idle), 1 for GPUs.
    """
    if link_from not in LINK_SOURCES:
        raise ClusterSpecError(f"link_from is {link_from!r}; expected one of {LINK_SOURCES}.")
    n = len(hw.devices)
    figures = ", ".join(f"{p} {f / 1e12:.3g}" for p, f in hw.best_flops_per_s())
    mem = hw.memory_bandwidth
    overhead = hw.layer_overhead
    device = DeviceSpec(
        kind=hw.device_kind, device_type=hw.device_type, memory_bytes=hw.memory_bytes_per_device,
        peak_flops_per_s=hw.best_flops_per_s(),
        memory_bandwidth_bytes_per_s=mem.bandwidth_bytes_per_s, matmul_efficiency=1.0,
        source=f"measured on {hw.devices[0]} by `plan profile-hardware`"
               f"{' (quick)' if hw.quick else ''} (TensorFlow {hw.tensorflow_version}): "
               f"peak_flops_per_s is the best ACHIEVED square-matmul rate, not a datasheet peak "
               f"(TFLOP/s: {figures}), hence matmul_efficiency 1.0; memory bandwidth "
               f"{mem.bandwidth_bytes_per_s / 1e9:.3g} GB/s from in-place a += b over "
               f"2 x {mem.buffer_bytes / MiB:g} MiB; memory: {hw.memory_source}"
               + ("" if overhead is None else
                  f"; layer_overhead_s {overhead.overhead_s * 1e6:.3g} us = one more "
                  f"Dense({overhead.width}) on {overhead.batch} x {overhead.width}, forward + "
                  f"backward, {overhead.seconds * 1e6:.3g} us measured, less its FLOP time "
                  f"{overhead.flop_time_s * 1e6:.3g} us"),
        layer_overhead_s=None if overhead is None else overhead.overhead_s)
    order = (link_from,) + tuple(s for s in LINK_SOURCES if s != link_from)
    link = None
    for source in order:
        link = _allreduce_link(hw) if source == "allreduce" else _p2p_link(hw, flat=False)
        if link is not None:
            break
    if link is None:
        why = ("one device measured: no link" if n == 1 else
               "no measured time grew with the message size, so no bandwidth could be fitted")
        link = LinkSpec(bandwidth_bytes_per_s=mem.bandwidth_bytes_per_s, latency_s=0.0,
                        source=f"placeholder ({why}): memory bandwidth, zero latency")
    return ClusterSpec(name=name or f"measured:{n}x{hw.device_kind}", num_nodes=1,
                       devices_per_node=n, device=device, intra_node_link=link,
                       intra_node_p2p_link=_p2p_link(hw, flat=True),
                       devices_per_compute_pool=n if hw.device_type == "CPU" else 1)


def summary_rows(hw: HardwareProfile, cluster: ClusterSpec) -> list[tuple[str, str, str]]:
    """Display rows (what, measured, detail) for a terminal table."""
    rows = [("devices", f"{len(hw.devices)} x {hw.device_kind}", ", ".join(hw.devices)),
            ("memory per device", f"{hw.memory_bytes_per_device / 2**30:.1f} GiB",
             hw.memory_source)]
    for m in hw.matmul:
        pts = " ".join(f"{p.n}:{p.flops_per_s / 1e9:.3g}" for p in m.points)
        rows.append((f"matmul {m.precision}", f"{m.best_flops_per_s / 1e12:.3g} TFLOP/s",
                     f"best at n={m.best.n}; GFLOP/s by n: {pts}"))
    bw = hw.memory_bandwidth
    rows.append(("memory bandwidth", f"{bw.bandwidth_bytes_per_s / 1e9:.3g} GB/s",
                 f"a += b, 2 x {bw.buffer_bytes / MiB:g} MiB, {bw.seconds * 1e3:.3g} ms"))
    for p in hw.p2p:
        rows.append((f"p2p {_bare(p.src)}->{_bare(p.dst)}",
                     _fit_text(p.fit), _range_text(p.points)))
    if hw.allreduce is not None:
        a = hw.allreduce
        bus = a.bus_bandwidth_bytes_per_s
        rows.append((f"all-reduce x{len(a.devices)}", _fit_text(a.fit),
                     f"{a.implementation}; busbw "
                     f"{'-' if bus is None else f'{bus / 1e9:.3g} GB/s'}; "
                     + _range_text(a.points)))
    if hw.layer_overhead is not None:
        o = hw.layer_overhead
        rows.append(("layer overhead", f"{o.overhead_s * 1e6:.3g} us",
                     f"Dense({o.width}) on {o.batch} x {o.width}, forward + backward: "
                     f"{o.seconds * 1e6:.3g} us, less {o.flop_time_s * 1e6:.3g} us of FLOPs "
                     f"({o.flops} at {o.flops_per_s / 1e9:.3g} GFLOP/s)"))
    if cluster.intra_node_p2p_link is not None:
        rows.append(("cluster p2p link", _link_text(cluster.intra_node_p2p_link),
                     cluster.intra_node_p2p_link.source))
    link = cluster.intra_node_link
    rows.append(("cluster link", _link_text(link), "collectives; " + link.source))
    return rows


# --- helpers --------------------------------------------------------------------------
def _allreduce_link(hw: HardwareProfile) -> LinkSpec | None:
    a = hw.allreduce
    if a is None or a.bus_bandwidth_bytes_per_s is None:
        return None
    n = len(a.devices)
    return LinkSpec(
        bandwidth_bytes_per_s=a.bus_bandwidth_bytes_per_s, latency_s=a.step_latency_s,
        source=f"measured all-reduce over {n} devices ({a.implementation}), fit t = "
               f"{a.fit.latency_s * 1e6:.3g} us + N / {a.fit.bandwidth_bytes_per_s / 1e9:.3g} "
               f"GB/s (R2 {a.fit.r2:.3f}); per link: busbw = algbw x 2(n-1)/n (nccl-tests "
               f"PERFORMANCE.md) = {a.bus_bandwidth_bytes_per_s / 1e9:.3g} GB/s, latency = "
               f"alpha / 2(n-1) = {a.step_latency_s * 1e6:.3g} us per ring step")


def _p2p_link(hw: HardwareProfile, flat: bool) -> LinkSpec | None:
    """The slowest measured pair: the lowest bandwidth, the highest latency.

    A pair whose fit has no bandwidth (time flat in the size) bounds it from
    below by max(N / t) over its points; with ``flat`` such pairs count with
    that bound, without it they are ignored (None when no pair has a fitted one).
    """
    if not hw.p2p:
        return None
    fitted = [p.fit.bandwidth_bytes_per_s for p in hw.p2p
              if p.fit.bandwidth_bytes_per_s is not None]
    bounds = [max(q.nbytes / q.seconds for q in p.points) for p in hw.p2p
              if p.fit.bandwidth_bytes_per_s is None]
    if not fitted and not (flat and bounds):
        return None
    bandwidth = min(fitted + (bounds if flat else []))
    latency = max(p.fit.latency_s for p in hw.p2p)
    pairs = ", ".join(f"{p.src}->{p.dst}" for p in hw.p2p)
    how = ("" if not (flat and bounds) else
           "; no time grew with the size for "
           f"{len(bounds)} pair(s), bounded below by max(N / t) = {min(bounds) / 1e9:.3g} GB/s")
    return LinkSpec(bandwidth_bytes_per_s=bandwidth, latency_s=latency,
                    source=f"measured point-to-point copies ({pairs}), alpha-beta fits; the "
                           f"slowest pair: {bandwidth / 1e9:.3g} GB/s, {latency * 1e6:.3g} us"
                           + how)


def _link_text(link: LinkSpec) -> str:
    return f"{link.bandwidth_bytes_per_s / 1e9:.3g} GB/s, {link.latency_s * 1e6:.3g} us"


def _fit_text(fit: AlphaBetaFit) -> str:
    bw = fit.bandwidth_bytes_per_s
    return (f"{fit.latency_s * 1e6:.3g} us + N / "
            f"{'inf' if bw is None else f'{bw / 1e9:.3g} GB/s'} (R2 {fit.r2:.2f})")


def _range_text(points: tuple[CommPoint, ...]) -> str:
    return " ".join(f"{_bytes_text(p.nbytes)}:{p.seconds * 1e3:.3g}ms" for p in points)


def _bytes_text(n: int) -> str:
    if n >= MiB:
        return f"{n / MiB:g}MiB"
    return f"{n / KiB:g}KiB" if n >= KiB else f"{n}B"


def _bare(name: str) -> str:
    """``/device:CPU:0`` -> ``CPU:0``."""
    return name.split("device:")[-1]
