"""The hardware a plan is made for: ``DeviceSpec``, ``LinkSpec``, ``ClusterSpec``.

Pipeline position: built from a preset (``tfplan.core.presets``), a YAML/JSON file,
``cpu:N``, or later a measurement (``plan profile-hardware``); read by the cost
model and the search. A cluster is ``num_nodes`` identical nodes of
``devices_per_node`` identical devices; devices in a node talk over
``intra_node_link``, nodes over ``inter_node_link``.

Collectives and point-to-point transfers may cost differently on the same
wires: a collective (TensorFlow's ring all-reduce) pays a per-step launch and
synchronisation a single copy does not. The collective links price gradient
all-reduces; the optional ``intra_node_p2p_link`` / ``inter_node_p2p_link``
price single transfers (pipeline stage boundaries), and ``p2p_link`` falls back
to the collective link of the same level when no p2p link is given.

``devices_per_compute_pool`` says how many of a node's devices draw on one pool
of cores and memory bandwidth: 1 for GPUs; all of them for logical CPU devices,
which share one thread pool (DESIGN.md), so that k of them busy at once each
run at about 1/k of the rate measured on one.
"""
from __future__ import annotations

from dataclasses import dataclass, field as dc_field
from typing import Any, Mapping

from tfplan.core.errors import ClusterSpecError, SchemaError
from tfplan.core.schema import SCHEMA_VERSION, check_version, field

PRECISIONS = ("float32", "tf32", "float16", "bfloat16")


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or one logical CPU device)."""

    kind: str  # "A100-80GB", "CPU", ...
    device_type: str  # TensorFlow device type: "GPU" or "CPU"
    memory_bytes: int
    peak_flops_per_s: tuple[tuple[str, float], ...]  # (precision, dense FLOP/s) pairs
    memory_bandwidth_bytes_per_s: float
    matmul_efficiency: float  # achieved / peak for large dense matmuls (see presets)
    source: str = ""
    # Measured fixed time one layer's forward + backward ops cost per pass beyond their
    # FLOPs (op dispatch, kernel launch); None: the cost model's assumed constant.
    layer_overhead_s: float | None = None

    def peak_flops(self, precision: str) -> float:
        """Peak dense FLOP/s for a compute precision (``mixed_float16`` -> float16)."""
        key = compute_precision(precision)
        table = dict(self.peak_flops_per_s)
        # TensorFlow runs float32 matmuls and convolutions in TF32 on GPUs that have it
        # (tf.config.experimental.enable_tensor_float_32_execution defaults to True since
        # TF 2.4), so a float32 model is priced at the TF32 peak where the device lists one.
        if key == "float32" and "tf32" in table:
            return table["tf32"]
        if key in table:
            return table[key]
        raise ClusterSpecError(
            f"Device {self.kind} has no peak FLOP/s for precision {key!r}; it lists "
            f"{sorted(table)}. Add it to the cluster file under peak_flops_per_s.")

    def achieved_flops(self, precision: str) -> float:
        return self.peak_flops(precision) * self.matmul_efficiency

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "device_type": self.device_type,
            "memory_bytes": self.memory_bytes,
            "peak_flops_per_s": dict(self.peak_flops_per_s),
            "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s,
            "matmul_efficiency": self.matmul_efficiency, "source": self.source,
            "layer_overhead_s": self.layer_overhead_s,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "device") -> "DeviceSpec":
        k = "ClusterSpec"
        if not isinstance(d, Mapping):
            raise SchemaError(f"{k}.{where}: expected an object, received {d!r}.")
        peaks = field(d, "peak_flops_per_s", k, dict, where=where)
        for p, v in peaks.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise SchemaError(f"{k}.{where}.peak_flops_per_s.{p} is {v!r}; expected a "
                                  "positive number of FLOP/s (e.g. 312e12).")
        device_type = field(d, "device_type", k, str, where=where, optional=True, default="GPU")
        if device_type not in ("GPU", "CPU"):
            raise SchemaError(f"{k}.{where}.device_type is {device_type!r}; expected GPU or CPU.")
        eff = field(d, "matmul_efficiency", k, float, where=where, optional=True, default=0.5)
        if not 0 < eff <= 1:
            raise SchemaError(f"{k}.{where}.matmul_efficiency is {eff!r}; expected 0 < x <= 1.")
        overhead = d.get("layer_overhead_s")
        if overhead is not None:
            overhead = field(d, "layer_overhead_s", k, float, where=where, minimum=0)
        return cls(
            kind=field(d, "kind", k, str, where=where), device_type=device_type,
            memory_bytes=field(d, "memory_bytes", k, int, where=where, minimum=1),
            peak_flops_per_s=tuple(sorted((str(p), float(v)) for p, v in peaks.items())),
            memory_bandwidth_bytes_per_s=field(d, "memory_bandwidth_bytes_per_s", k, float,
                                               where=where, minimum=1),
            matmul_efficiency=eff,
            source=field(d, "source", k, str, where=where, optional=True, default=""),
            layer_overhead_s=overhead,
        )


@dataclass(frozen=True)
class LinkSpec:
    """A link level with an alpha-beta cost: time(n bytes) = latency_s + n / bandwidth."""

    bandwidth_bytes_per_s: float  # per device, one direction
    latency_s: float
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                "latency_s": self.latency_s, "source": self.source}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> "LinkSpec":
        k = "ClusterSpec"
        if not isinstance(d, Mapping):
            raise SchemaError(f"{k}.{where}: expected an object, received {d!r}.")
        return cls(
            bandwidth_bytes_per_s=field(d, "bandwidth_bytes_per_s", k, float, where=where,
                                        minimum=1),
            latency_s=field(d, "latency_s", k, float, where=where, minimum=0),
            source=field(d, "source", k, str, where=where, optional=True, default=""),
        )


@dataclass(frozen=True)
class ClusterSpec:
    """``num_nodes`` x ``devices_per_node`` identical devices."""

    name: str
    num_nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node_link: LinkSpec  # collectives (all-reduce) inside a node
    inter_node_link: LinkSpec | None = None  # collectives across nodes
    intra_node_p2p_link: LinkSpec | None = None  # one transfer inside a node; None: collective's
    inter_node_p2p_link: LinkSpec | None = None  # one transfer across nodes; None: collective's
    devices_per_compute_pool: int = 1  # devices sharing one pool of cores (see module doc)
    schema_version: int = dc_field(default=SCHEMA_VERSION)

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.devices_per_node < 1:
            raise ClusterSpecError(
                f"Cluster {self.name!r} has {self.num_nodes} nodes x {self.devices_per_node} "
                "devices; both must be at least 1.")
        if self.num_nodes > 1 and self.inter_node_link is None:
            raise ClusterSpecError(
                f"Cluster {self.name!r} has {self.num_nodes} nodes but no inter_node_link; "
                "add one (bandwidth_bytes_per_s, latency_s) to the cluster file.")
        pool = self.devices_per_compute_pool
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1 \
                or self.devices_per_node % pool:
            raise ClusterSpecError(
                f"Cluster {self.name!r} has devices_per_compute_pool {pool!r}; expected a whole "
                f"number >= 1 that divides devices_per_node ({self.devices_per_node}): 1 for "
                "GPUs, devices_per_node for logical CPU devices sharing the host's cores.")

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    def device_names(self) -> tuple[str, ...]:
        """TensorFlow device names, node-major. One node: ``/device:GPU:i``;
        several nodes: ``/job:worker/task:n/device:GPU:i``."""
        t = self.device.device_type
        if self.num_nodes == 1:
            return tuple(f"/device:{t}:{i}" for i in range(self.devices_per_node))
        return tuple(f"/job:worker/task:{n}/device:{t}:{i}"
                     for n in range(self.num_nodes) for i in range(self.devices_per_node))

    def link_between(self, group_size: int) -> LinkSpec:
        """The slowest link a group of ``group_size`` consecutive devices must cross."""
        if group_size <= self.devices_per_node or self.inter_node_link is None:
            return self.intra_node_link
        return self.inter_node_link

    def p2p_link(self, same_node: bool) -> LinkSpec:
        """The link one point-to-point transfer (a pipeline stage boundary) crosses.

        Inside a node: ``intra_node_p2p_link``, else ``intra_node_link``. Across
        nodes: ``inter_node_p2p_link``, else ``inter_node_link``; with neither
        (one node), the intra-node choice.
        """
        if not same_node:
            if self.inter_node_p2p_link is not None:
                return self.inter_node_p2p_link
            if self.inter_node_link is not None:
                return self.inter_node_link
        if self.intra_node_p2p_link is not None:
            return self.intra_node_p2p_link
        return self.intra_node_link

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version, "name": self.name,
            "num_nodes": self.num_nodes, "devices_per_node": self.devices_per_node,
            "device": self.device.to_dict(), "intra_node_link": self.intra_node_link.to_dict(),
            "inter_node_link": _link_dict(self.inter_node_link),
            "intra_node_p2p_link": _link_dict(self.intra_node_p2p_link),
            "inter_node_p2p_link": _link_dict(self.inter_node_p2p_link),
            "devices_per_compute_pool": self.devices_per_compute_pool,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ClusterSpec":
        k = "ClusterSpec"
        check_version(d, k)
        def link(key: str) -> LinkSpec | None:  # optional: files before p2p links lack them
            value = d.get(key)
            return None if value is None else LinkSpec.from_dict(value, key)

        return cls(
            name=field(d, "name", k, str),
            num_nodes=field(d, "num_nodes", k, int, minimum=1),
            devices_per_node=field(d, "devices_per_node", k, int, minimum=1),
            device=DeviceSpec.from_dict(field(d, "device", k, dict)),
            intra_node_link=LinkSpec.from_dict(field(d, "intra_node_link", k, dict),
                                               "intra_node_link"),
            inter_node_link=link("inter_node_link"),
            intra_node_p2p_link=link("intra_node_p2p_link"),
            inter_node_p2p_link=link("inter_node_p2p_link"),
            devices_per_compute_pool=field(d, "devices_per_compute_pool", k, int, minimum=1,
                                           optional=True, default=1),
        )


def _link_dict(link: LinkSpec | None) -> dict[str, Any] | None:
    return None if link is None else link.to_dict()


def compute_precision(precision: str) -> str:
    """Map a Keras dtype policy name to the precision its matmuls run in."""
    table = {"float32": "float32", "mixed_float16": "float16", "float16": "float16",
             "mixed_bfloat16": "bfloat16", "bfloat16": "bfloat16", "tf32": "tf32"}
    if precision not in table:
        raise ClusterSpecError(
            f"Unknown precision {precision!r}; expected one of {sorted(table)}.")
    return table[precision]
