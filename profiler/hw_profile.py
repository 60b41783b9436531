"""The hardware profile value: measured matmul FLOP/s, memory bandwidth and link costs.

Pipeline position: ``profiler.hardware.profile_hardware`` measures this host's
devices into a ``HardwareProfile``; ``profiler.hardware.to_cluster_spec`` turns
it into the ``ClusterSpec`` the planner reads instead of a datasheet preset.
This module imports no TensorFlow (numpy and scipy only, for the alpha-beta
fit), so a saved profile loads on any machine.

Units are in the names: bytes, seconds, FLOP/s, bytes/s. Every measured point
keeps its raw ``seconds``; rates (FLOP/s, bandwidths) are derived from them and
written to JSON for readers, but not read back (they are recomputed).
"""
from __future__ import annotations

from dataclasses import dataclass, field as dc_field
from typing import Any, Mapping, Sequence

from tfplan.core.errors import SchemaError
from tfplan.core.schema import SCHEMA_VERSION, check_version, field

KIND = "HardwareProfile"
METHODS = ("difference", "upper_bound")


@dataclass(frozen=True)
class MatmulPoint:
    """One square matmul C = A @ B of n x n matrices: 2 n^3 FLOPs (n^3 multiply-adds)."""

    n: int
    seconds: float
    method: str = "difference"  # see profiler.hw_timing

    @property
    def flops(self) -> int:
        return 2 * self.n ** 3

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "seconds": self.seconds, "flops_per_s": self.flops_per_s,
                "method": self.method}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> "MatmulPoint":
        return cls(n=field(d, "n", KIND, int, where=where, minimum=1),
                   seconds=_positive(d, "seconds", where),
                   method=_method(d, where))


@dataclass(frozen=True)
class MatmulResult:
    """Achieved matmul FLOP/s for one precision over a range of sizes."""

    precision: str  # TensorFlow dtype name: float32, float16, bfloat16
    points: tuple[MatmulPoint, ...]

    @property
    def best(self) -> MatmulPoint:
        return max(self.points, key=lambda p: p.flops_per_s)

    @property
    def best_flops_per_s(self) -> float:
        return self.best.flops_per_s

    def to_dict(self) -> dict[str, Any]:
        return {"precision": self.precision, "best_flops_per_s": self.best_flops_per_s,
                "best_n": self.best.n, "points": [p.to_dict() for p in self.points]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> "MatmulResult":
        points = field(d, "points", KIND, list, where=where)
        if not points:
            raise SchemaError(f"{KIND}.{where}.points is empty; expected at least one point.")
        return cls(precision=field(d, "precision", KIND, str, where=where),
                   points=tuple(MatmulPoint.from_dict(p, f"{where}.points[{i}]")
                                for i, p in enumerate(points)))


@dataclass(frozen=True)
class MemoryBandwidth:
    """In-place ``a += b`` over two float32 buffers of ``buffer_bytes`` each.

    Bytes moved per pass = 3 x buffer_bytes (read a, read b, write a), counted as
    STREAM does: reads plus writes, write-allocate traffic not counted
    (McCalpin, "Memory Bandwidth and Machine Balance in Current High Performance
    Computers", IEEE TCCA Newsletter, 1995; the STREAM "add" kernel).
    """

    buffer_bytes: int
    seconds: float  # one pass
    method: str = "difference"

    @property
    def bytes_moved(self) -> int:
        return 3 * self.buffer_bytes

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bytes_moved / self.seconds

    def to_dict(self) -> dict[str, Any]:
        return {"buffer_bytes": self.buffer_bytes, "bytes_moved": self.bytes_moved,
                "seconds": self.seconds, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                "method": self.method}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> "MemoryBandwidth":
        return cls(buffer_bytes=field(d, "buffer_bytes", KIND, int, where=where, minimum=1),
                   seconds=_positive(d, "seconds", where), method=_method(d, where))


@dataclass(frozen=True)
class LayerOverhead:
    """The fixed cost of one small layer's forward + backward pass beyond its FLOPs.

    A Keras ``Dense(width)`` on a ``batch x width`` input, called once more in a
    chain inside one ``tf.function`` with a ``GradientTape`` (see
    ``profiler.hw_compute.layer_overhead``): ``seconds`` is the time one more
    call adds, forward and backward (MatMul, BiasAdd, Relu; ReluGrad, two
    MatMuls, BiasAddGrad; the variable reads). Its FLOPs are
    ``6 batch width^2`` (2 for the forward matmul, 4 for the two backward ones:
    Kaplan et al., "Scaling Laws for Neural Language Models", 2020, Sec. 2.1);
    at the measured matmul rate ``flops_per_s`` they take ``flop_time_s``, and
    the rest is the overhead: op dispatch and kernel launch.
    """

    batch: int
    width: int
    seconds: float  # one layer, forward + backward
    flops_per_s: float  # the matmul rate its FLOPs are priced at (the best measured)
    method: str = "difference"

    @property
    def flops(self) -> int:
        return 6 * self.batch * self.width ** 2

    @property
    def flop_time_s(self) -> float:
        return self.flops / self.flops_per_s

    @property
    def overhead_s(self) -> float:
        """seconds - flop_time_s, at least 0."""
        return max(0.0, self.seconds - self.flop_time_s)

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "width": self.width, "seconds": self.seconds,
                "flops": self.flops, "flops_per_s": self.flops_per_s,
                "flop_time_s": self.flop_time_s, "overhead_s": self.overhead_s,
                "method": self.method}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> "LayerOverhead":
        return cls(batch=field(d, "batch", KIND, int, where=where, minimum=1),
                   width=field(d, "width", KIND, int, where=where, minimum=1),
                   seconds=_positive(d, "seconds", where),
                   flops_per_s=_positive(d, "flops_per_s", where, "FLOP/s"),
                   method=_method(d, where))


@dataclass(frozen=True)
class CommPoint:
    """One message size and the time of one operation on it."""

    nbytes: int
    seconds: float
    method: str = "difference"

    def to_dict(self) -> dict[str, Any]:
        return {"nbytes": self.nbytes, "seconds": self.seconds, "method": self.method}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> "CommPoint":
        return cls(nbytes=field(d, "nbytes", KIND, int, where=where, minimum=1),
                   seconds=_positive(d, "seconds", where), method=_method(d, where))


@dataclass(frozen=True)
class AlphaBetaFit:
    """t(n) = alpha + n / beta fitted to measured points (Hockney, 1994).

    ``latency_s`` is alpha; ``bandwidth_bytes_per_s`` is beta, or None when the
    time did not grow with the message size at all (the fitted slope is 0: no
    bytes moved that the clock could see, e.g. logical CPU devices handing each
    other a shared buffer). ``r2`` is the coefficient of determination on the
    raw times; ``max_relative_error`` is max |fit - t| / t over the points.
    """

    latency_s: float
    bandwidth_bytes_per_s: float | None
    r2: float
    max_relative_error: float

    def predict_s(self, nbytes: float) -> float:
        if self.bandwidth_bytes_per_s is None:
            return self.latency_s
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        return {"latency_s": self.latency_s, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                "r2": self.r2, "max_relative_error": self.max_relative_error}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> "AlphaBetaFit":
        bw = d.get("bandwidth_bytes_per_s")
        return cls(latency_s=field(d, "latency_s", KIND, float, where=where, minimum=0),
                   bandwidth_bytes_per_s=(None if bw is None else field(
                       d, "bandwidth_bytes_per_s", KIND, float, where=where, minimum=0)),
                   r2=field(d, "r2", KIND, float, where=where),
                   max_relative_error=field(d, "max_relative_error", KIND, float, where=where,
                                            minimum=0))


@dataclass(frozen=True)
class P2PResult:
    """Copies of a tensor between ``src`` and ``dst``, one hop each way in turn (see
    ``profiler.hw_comm``); a point is the time of one hop."""

    src: str
    dst: str
    points: tuple[CommPoint, ...]
    fit: AlphaBetaFit

    def to_dict(self) -> dict[str, Any]:
        return {"src": self.src, "dst": self.dst, "fit": self.fit.to_dict(),
                "points": [p.to_dict() for p in self.points]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> "P2PResult":
        return cls(src=field(d, "src", KIND, str, where=where),
                   dst=field(d, "dst", KIND, str, where=where),
                   points=_points(d, where),
                   fit=AlphaBetaFit.from_dict(field(d, "fit", KIND, dict, where=where),
                                              f"{where}.fit"))


@dataclass(frozen=True)
class AllReduceResult:
    """Sum all-reduce of ``nbytes`` per device over ``devices`` with TensorFlow's
    ``CollectiveReduceV2`` (``implementation`` = its communication_hint).

    ``fit`` is in algorithm terms: t(N) = alpha + N / algbw for N bytes per
    device. The per-link ("bus") figures follow NCCL-tests' convention
    (nccl-tests doc/PERFORMANCE.md, "Bus bandwidth"): busbw = algbw x 2(n-1)/n,
    the rate each device's link runs at in a ring all-reduce; and a ring takes
    2(n-1) steps, so the per-step latency is alpha / (2(n-1)). With these two as
    the link, ``planner.collectives.ring_allreduce_time_s`` reproduces ``fit``.
    """

    devices: tuple[str, ...]
    implementation: str
    points: tuple[CommPoint, ...]
    fit: AlphaBetaFit

    @property
    def bus_factor(self) -> float:
        n = len(self.devices)
        return 2 * (n - 1) / n

    @property
    def bus_bandwidth_bytes_per_s(self) -> float | None:
        bw = self.fit.bandwidth_bytes_per_s
        return None if bw is None else bw * self.bus_factor

    @property
    def step_latency_s(self) -> float:
        return self.fit.latency_s / (2 * (len(self.devices) - 1))

    def to_dict(self) -> dict[str, Any]:
        return {"devices": list(self.devices), "implementation": self.implementation,
                "fit": self.fit.to_dict(), "bus_factor": self.bus_factor,
                "bus_bandwidth_bytes_per_s": self.bus_bandwidth_bytes_per_s,
                "step_latency_s": self.step_latency_s,
                "points": [p.to_dict() for p in self.points]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> "AllReduceResult":
        devices = tuple(field(d, "devices", KIND, list, where=where))
        if len(devices) < 2:
            raise SchemaError(f"{KIND}.{where}.devices is {list(devices)}; an all-reduce needs "
                              "at least two devices.")
        return cls(devices=devices,
                   implementation=field(d, "implementation", KIND, str, where=where),
                   points=_points(d, where),
                   fit=AlphaBetaFit.from_dict(field(d, "fit", KIND, dict, where=where),
                                              f"{where}.fit"))


@dataclass(frozen=True)
class HardwareProfile:
    """Everything ``profile_hardware`` measured on one host's devices."""

    device_type: str  # "GPU" or "CPU"
    device_kind: str  # "NVIDIA H100 80GB HBM3", "CPU", ...
    devices: tuple[str, ...]  # TensorFlow names, e.g. /device:GPU:0
    memory_bytes_per_device: int
    memory_source: str  # how memory_bytes_per_device was obtained
    matmul: tuple[MatmulResult, ...]  # measured on devices[0]
    memory_bandwidth: MemoryBandwidth  # measured on devices[0]
    p2p: tuple[P2PResult, ...] = ()
    allreduce: AllReduceResult | None = None  # None with one device
    layer_overhead: LayerOverhead | None = None  # measured on devices[0]; None: not measured
    tensorflow_version: str = ""
    quick: bool = False
    notes: tuple[str, ...] = ()
    schema_version: int = dc_field(default=SCHEMA_VERSION)

    def best_flops_per_s(self) -> tuple[tuple[str, float], ...]:
        """(precision, best measured FLOP/s) pairs, sorted by precision."""
        return tuple(sorted((m.precision, m.best_flops_per_s) for m in self.matmul))

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version, "device_type": self.device_type,
            "device_kind": self.device_kind, "devices": list(self.devices),
            "memory_bytes_per_device": self.memory_bytes_per_device,
            "memory_source": self.memory_source,
            "matmul": [m.to_dict() for m in self.matmul],
            "memory_bandwidth": self.memory_bandwidth.to_dict(),
            "p2p": [p.to_dict() for p in self.p2p],
            "allreduce": None if self.allreduce is None else self.allreduce.to_dict(),
            "layer_overhead": (None if self.layer_overhead is None
                               else self.layer_overhead.to_dict()),
            "tensorflow_version": self.tensorflow_version, "quick": self.quick,
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "HardwareProfile":
        check_version(d, KIND)
        device_type = field(d, "device_type", KIND, str)
        if device_type not in ("GPU", "CPU"):
            raise SchemaError(f"{KIND}.device_type is {device_type!r}; expected GPU or CPU.")
        matmul = field(d, "matmul", KIND, list)
        if not matmul:
            raise SchemaError(f"{KIND}.matmul is empty; expected one entry per precision.")
        allreduce = d.get("allreduce")
        overhead = d.get("layer_overhead")  # optional: profiles from before it was measured
        return cls(
            device_type=device_type, device_kind=field(d, "device_kind", KIND, str),
            devices=tuple(field(d, "devices", KIND, list)),
            memory_bytes_per_device=field(d, "memory_bytes_per_device", KIND, int, minimum=1),
            memory_source=field(d, "memory_source", KIND, str, optional=True, default=""),
            matmul=tuple(MatmulResult.from_dict(m, f"matmul[{i}]") for i, m in enumerate(matmul)),
            memory_bandwidth=MemoryBandwidth.from_dict(
                field(d, "memory_bandwidth", KIND, dict), "memory_bandwidth"),
            p2p=tuple(P2PResult.from_dict(p, f"p2p[{i}]")
                      for i, p in enumerate(field(d, "p2p", KIND, list, optional=True,
                                                  default=[]))),
            allreduce=(None if allreduce is None
                       else AllReduceResult.from_dict(allreduce, "allreduce")),
            layer_overhead=(None if overhead is None
                            else LayerOverhead.from_dict(overhead, "layer_overhead")),
            tensorflow_version=field(d, "tensorflow_version", KIND, str, optional=True,
                                     default=""),
            quick=field(d, "quick", KIND, bool, optional=True, default=False),
            notes=tuple(field(d, "notes", KIND, list, optional=True, default=[])),
        )


def fit_alpha_beta(points: Sequence[CommPoint]) -> AlphaBetaFit:
    """Least-squares fit of t = alpha + n / beta, alpha >= 0 and 1/beta >= 0.

    The residuals are relative, (alpha + s n - t) / t with s = 1/beta, so that
    4 KiB and 64 MiB messages weigh alike (an unweighted fit is decided by the
    largest sizes alone and leaves alpha to chance); the non-negativity
    constraints make it a non-negative least-squares problem, solved with
    ``scipy.optimize.nnls`` (Lawson & Hanson, "Solving Least Squares Problems",
    1974, ch. 23). Needs at least two distinct sizes.
    """
    import numpy as np
    from scipy.optimize import nnls

    sizes = sorted({p.nbytes for p in points})
    if len(sizes) < 2:
        raise ValueError(f"an alpha-beta fit needs at least two message sizes; got {sizes}")
    n = np.array([p.nbytes for p in points], dtype=float)
    t = np.array([p.seconds for p in points], dtype=float)
    scale = float(n.max())  # keep both columns O(1) for the solver
    a_matrix = np.stack([1.0 / t, (n / scale) / t], axis=1)
    (alpha, slope_scaled), _ = nnls(a_matrix, np.ones_like(t))
    slope = slope_scaled / scale  # seconds per byte
    pred = alpha + slope * n
    ss_res = float(np.sum((t - pred) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return AlphaBetaFit(latency_s=float(alpha),
                        bandwidth_bytes_per_s=float(1.0 / slope) if slope > 0 else None,
                        r2=float(r2), max_relative_error=float(np.max(np.abs(pred - t) / t)))


def _points(d: Mapping[str, Any], where: str) -> tuple[CommPoint, ...]:
    points = field(d, "points", KIND, list, where=where)
    return tuple(CommPoint.from_dict(p, f"{where}.points[{i}]") for i, p in enumerate(points))


def _positive(d: Mapping[str, Any], key: str, where: str, unit: str = "seconds") -> float:
    value = field(d, key, KIND, float, where=where)
    if not value > 0:
        raise SchemaError(f"{KIND}.{where}.{key} is {value!r}; expected a positive number of "
                          f"{unit}.")
    return value


def _method(d: Mapping[str, Any], where: str) -> str:
    method = field(d, "method", KIND, str, where=where, optional=True, default="difference")
    if method not in METHODS:
        raise SchemaError(f"{KIND}.{where}.method is {method!r}; expected one of {METHODS}.")
    return method
