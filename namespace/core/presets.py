"""Named clusters: ``cpu:N``, GPU server presets, ``NxPRESET`` and cluster files.

Pipeline position: turns the ``--cluster`` argument into a ``ClusterSpec`` that
the cost model and the search read. Imports nothing heavy (PyYAML only when a
YAML file is read), so the CLI can list presets instantly.

Accepted forms of ``parse_cluster(spec)``:

- ``cpu:N``             N logical CPU devices on this host (nominal figures);
- ``Wxcpu:N``           W worker processes (``/job:worker/task:w``) of N logical CPU
  devices each, such as ``2xcpu:1`` for ``plan launch --workers 2`` on one host;
- ``8xA100-80GB`` ...   one server of a named preset (``known_presets()``);
- ``64x8xA100-80GB``    64 nodes of that server, joined by its inter-node network;
- ``path.yaml|.yml|.json``  a ClusterSpec dict (``ClusterSpec.to_dict()`` layout;
  ``schema_version`` may be omitted) or ``{preset: 8xA100-80GB, nodes: 4}``.

GPU figures are the vendors' datasheet numbers for *dense* math (the datasheets'
headline tensor-core figures with structured sparsity are halved). Link
bandwidths are per GPU, one direction (NVLink figures in datasheets are the
bidirectional total, so they are halved too).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from tfplan.core.cluster import ClusterSpec, DeviceSpec, LinkSpec
from tfplan.core.errors import ClusterSpecError, SchemaError
from tfplan.core.schema import SCHEMA_VERSION, decode

GiB = 2**30

# --- matmul efficiency ------------------------------------------------------------
# Achieved / peak FLOP/s of the contractions (MatMul, Einsum, Conv) alone: the cost
# model prices element-wise and normalization ops by their memory traffic, and
# communication, pipeline bubbles and recomputation separately
# (planner/cost_model.py, ``roofline_time_s``).
# A100/H100: 0.6, calibrated on ONE configuration, the smallest row of Narayanan et
# al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM", SC'21, Table 1 (1.7B GPT on 32 A100s, data parallel only: no tensor or
# pipeline communication to confound it), which the cost model reproduces at 0.59.
# (Before that fit the value was 0.5, chosen from the whole table's 44-52% range.)
# With the authors' own settings the other nine rows (3.6B to 1T, up to 3072 GPUs) are
# predicted within 11.3% except the 1T row, -15.3% (README; benchmarks/megatron_table1.py). H100 assumed as A100 (no published
# calibration point in the repository).
# Shoeybi et al., "Megatron-LM" (2019), Sec. 5: 39 TFLOP/s per V100 on one GPU, 30%
# of the 125 TFLOP/s peak end to end; we take 0.3 for V100 (not re-calibrated for the
# op-class split: conservative).
AMPERE_HOPPER_EFFICIENCY = 0.6
VOLTA_EFFICIENCY = 0.3

# --- link latencies (assumptions, stated) -----------------------------------------
# Per-message latency of a NCCL step. nccl-tests all-reduce of tiny messages over
# NVLink/NVSwitch takes a few microseconds per step; we assume 5 us. Over
# InfiniBand the wire adds < 1 us (HDR/NDR switch ~130 ns) but NCCL's network
# proxy adds several; we assume 10 us. Both are assumptions, not measurements.
NVLINK_LATENCY_S = 5e-6
INFINIBAND_LATENCY_S = 10e-6

# --- cpu:N nominal figures ------------------------------------------------------------
CPU_NOMINAL_PEAK_FLOPS_PER_S = 50e9
CPU_NOMINAL_MEMORY_BANDWIDTH_BYTES_PER_S = 10e9
CPU_NOMINAL_LINK_BANDWIDTH_BYTES_PER_S = 5e9
CPU_NOMINAL_LINK_LATENCY_S = 20e-6
# A point-to-point transfer between two logical CPU devices is at most a same-host
# memory copy: each byte is read once and written once, 2 bytes of memory traffic per
# byte sent (STREAM "Copy" counts 2 x 8 bytes per element, McCalpin 1995), so
# beta = B_mem / 2. TensorFlow in fact hands a CPU buffer over without copying it
# (`plan profile-hardware` measures ~5 us whatever the size), so this is an upper
# bound on the time. Latency: one op dispatch, assumed 5 us (the measured hand-over).
CPU_NOMINAL_P2P_LATENCY_S = 5e-6
# Between CPU worker processes (``Wxcpu:N``): TensorFlow's collectives go over gRPC on
# TCP. Assumed 1 GB/s and 100 us per message (loopback or a datacenter network; not
# measured): nominal figures like the ones above.
CPU_NOMINAL_NETWORK_BANDWIDTH_BYTES_PER_S = 1e9
CPU_NOMINAL_NETWORK_LATENCY_S = 100e-6


@dataclass(frozen=True)
class _Server:
    """One node of a preset: ``devices_per_node`` devices, NVLink inside, IB outside."""

    devices_per_node: int
    device: DeviceSpec
    intra_node_link: LinkSpec
    inter_node_link: LinkSpec


def _nvlink(bidirectional_bytes_per_s: float, source: str) -> LinkSpec:
    return LinkSpec(bandwidth_bytes_per_s=bidirectional_bytes_per_s / 2,
                    latency_s=NVLINK_LATENCY_S,
                    source=f"{source}; per direction = half the bidirectional figure; "
                           f"latency {NVLINK_LATENCY_S * 1e6:g} us assumed (NCCL step)")


def _infiniband(gbit_per_s_per_gpu: float, source: str) -> LinkSpec:
    return LinkSpec(bandwidth_bytes_per_s=gbit_per_s_per_gpu * 1e9 / 8,
                    latency_s=INFINIBAND_LATENCY_S,
                    source=f"{source}; latency {INFINIBAND_LATENCY_S * 1e6:g} us assumed "
                           "(NCCL over InfiniBand)")


_A100_SOURCE = ("NVIDIA A100 Tensor Core GPU datasheet (2021), SXM: 312 TFLOP/s FP16/BF16 "
                "dense, 156 TF32, 19.5 FP32, {hbm}, NVLink 600 GB/s")
_A100_FLOPS = (("bfloat16", 312e12), ("float16", 312e12), ("float32", 19.5e12),
               ("tf32", 156e12))
_DGX_A100_IB = _infiniband(200, "DGX A100: 8x 200 Gb/s HDR InfiniBand per node, one per GPU "
                                "(NVIDIA DGX A100 datasheet, 2020)")


def _a100(kind: str, memory_gib: int, hbm_bytes_per_s: float, hbm: str) -> _Server:
    # A100-80GB: 80 GiB (nvidia-smi: 81920 MiB), HBM2e 2039 GB/s.
    # A100-40GB: 40 GiB (nvidia-smi: 40960 MiB), HBM2 1555 GB/s.
    source = _A100_SOURCE.format(hbm=hbm)
    return _Server(
        devices_per_node=8,
        device=DeviceSpec(kind=kind, device_type="GPU", memory_bytes=memory_gib * GiB,
                          peak_flops_per_s=_A100_FLOPS,
                          memory_bandwidth_bytes_per_s=hbm_bytes_per_s,
                          matmul_efficiency=AMPERE_HOPPER_EFFICIENCY,
                          source=source + "; matmul_efficiency 0.6 calibrated on Megatron-LM "
                                          "SC'21 Table 1, 1.7B row (planner/presets.py)"),
        intra_node_link=_nvlink(600e9, "A100 NVLink 600 GB/s per GPU (NVSwitch)"),
        inter_node_link=_DGX_A100_IB,
    )


# NVIDIA H100 Tensor Core GPU datasheet (2023), SXM5: FP32 67 TFLOP/s; TF32 989,
# FP16/BF16 1979 TFLOP/s *with sparsity* -> 494.7 / 989.4 dense (H100 whitepaper);
# 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s. DGX H100: 8x 400 Gb/s NDR ConnectX-7.
_H100 = _Server(
    devices_per_node=8,
    device=DeviceSpec(
        kind="H100-80GB", device_type="GPU", memory_bytes=80 * GiB,
        peak_flops_per_s=(("bfloat16", 989.4e12), ("float16", 989.4e12), ("float32", 67e12),
                          ("tf32", 494.7e12)),
        memory_bandwidth_bytes_per_s=3.35e12, matmul_efficiency=AMPERE_HOPPER_EFFICIENCY,
        source="NVIDIA H100 Tensor Core GPU datasheet (2023), SXM5: 989 TFLOP/s FP16/BF16 "
               "dense (1979 with sparsity), 495 TF32, 67 FP32, 3.35 TB/s HBM3, NVLink "
               "900 GB/s; matmul_efficiency 0.6 assumed as for A100 (planner/presets.py)"),
    intra_node_link=_nvlink(900e9, "H100 NVLink 900 GB/s per GPU (NVSwitch)"),
    inter_node_link=_infiniband(400, "DGX H100: 8x 400 Gb/s NDR InfiniBand (ConnectX-7) per "
                                     "node, one per GPU (NVIDIA DGX H100 datasheet, 2023)"),
)

# NVIDIA Tesla V100 datasheet (2020), SXM2 32GB: FP32 15.7 TFLOP/s, tensor (FP16) 125,
# HBM2 900 GB/s, NVLink 300 GB/s; no TF32 or BF16. DGX-1: hybrid cube-mesh NVLink,
# 4x 100 Gb/s EDR InfiniBand per 8 GPUs = 50 Gb/s per GPU.
_V100 = _Server(
    devices_per_node=8,
    device=DeviceSpec(
        kind="V100-32GB", device_type="GPU", memory_bytes=32 * GiB,
        peak_flops_per_s=(("float16", 125e12), ("float32", 15.7e12)),
        memory_bandwidth_bytes_per_s=900e9, matmul_efficiency=VOLTA_EFFICIENCY,
        source="NVIDIA Tesla V100 datasheet (2020), SXM2: 125 TFLOP/s FP16 tensor, 15.7 FP32, "
               "900 GB/s HBM2, NVLink 300 GB/s; matmul_efficiency 0.3 from Megatron-LM (2019): "
               "39 TFLOP/s per V100 = 30% of peak"),
    intra_node_link=_nvlink(300e9, "V100 NVLink 300 GB/s per GPU (DGX-1 hybrid cube-mesh; "
                                   "NCCL rings use all links)"),
    inter_node_link=_infiniband(50, "DGX-1: 4x 100 Gb/s EDR InfiniBand per 8 GPUs "
                                    "(NVIDIA DGX-1 datasheet)"),
)

_PRESETS: dict[str, _Server] = {
    "8xA100-80GB": _a100("A100-80GB", 80, 2039e9, "2039 GB/s HBM2e"),
    "8xA100-40GB": _a100("A100-40GB", 40, 1555e9, "1555 GB/s HBM2"),
    "8xH100-80GB": _H100,
    "8xV100-32GB": _V100,
}

FORMS = ("cpu:N (N logical CPU devices on this host)",
         "Wxcpu:N such as 2xcpu:1 (W worker processes of N logical CPU devices each)",
         "a preset name such as 8xA100-80GB",
         "NODESxPRESET such as 64x8xA100-80GB (64 nodes of that server)",
         "a path to a .yaml/.yml/.json cluster file")


def known_presets() -> tuple[str, ...]:
    """The names ``parse_cluster`` accepts as presets (one node each)."""
    return tuple(_PRESETS)


def parse_cluster(spec: str) -> ClusterSpec:
    """Turn ``--cluster`` text into a ClusterSpec (see the module docstring for forms)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ClusterSpecError(f"Cluster spec is {spec!r}; expected one of: {_forms()}.")
    text = spec.strip()
    if text.lower().endswith((".yaml", ".yml", ".json")) or os.path.isfile(text):
        return load_cluster_file(text)
    cpu = re.fullmatch(r"(?i)cpu:(\S+)", text)
    if cpu:
        return cpu_cluster(_positive_int(cpu.group(1), f"cpu:{cpu.group(1)}", "N"))
    workers = re.fullmatch(r"(?i)(\S+?)xcpu:(\S+)", text)
    if workers:
        return cpu_workers_cluster(_positive_int(workers.group(1), text, "the number of workers"),
                                   _positive_int(workers.group(2), text, "N"))
    preset = _lookup(text)
    if preset is not None:
        return preset_cluster(preset, 1)
    multi = re.fullmatch(r"(\d+)x(.+)", text)
    if multi and _lookup(multi.group(2)) is not None:
        nodes = _positive_int(multi.group(1), text, "the number of nodes")
        return preset_cluster(_lookup(multi.group(2)), nodes)
    raise ClusterSpecError(
        f"Unknown cluster {text!r}. Known presets: {', '.join(known_presets())}. "
        f"Accepted forms: {_forms()}.")


def preset_cluster(preset: str, nodes: int = 1) -> ClusterSpec:
    """``nodes`` servers of a named preset (``known_presets()``)."""
    name = _lookup(preset)
    if name is None:
        raise ClusterSpecError(f"Unknown preset {preset!r}. Known presets: "
                               f"{', '.join(known_presets())}.")
    server = _PRESETS[name]
    return ClusterSpec(
        name=name if nodes == 1 else f"{nodes}x{name}", num_nodes=nodes,
        devices_per_node=server.devices_per_node, device=server.device,
        intra_node_link=server.intra_node_link, inter_node_link=server.inter_node_link)


def cpu_cluster(n: int) -> ClusterSpec:
    """``n`` logical CPU devices on this host, with nominal (unmeasured) figures.

    Two links: ``intra_node_link`` prices collectives (all-reduce), and
    ``intra_node_p2p_link`` a single transfer, a same-host memory copy at half
    the memory bandwidth (see ``CPU_NOMINAL_P2P_LATENCY_S``). The n devices share
    the host's cores: ``devices_per_compute_pool`` = n.

    Memory per device = the host's physical memory // n (sysconf SC_PAGE_SIZE x
    SC_PHYS_PAGES): the logical devices share it.
    """
    try:
        host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError) as e:
        raise ClusterSpecError(
            f"cpu:{n}: cannot read this host's physical memory ({e}); describe the host in a "
            "cluster file instead (see `plan clusters --json` for the layout).") from e
    nominal = ("nominal figure, not measured: logical CPU devices share the host's cores; "
               "`plan profile-hardware` will measure it")
    device = DeviceSpec(
        kind="CPU", device_type="CPU", memory_bytes=host_bytes // n,
        peak_flops_per_s=tuple((p, CPU_NOMINAL_PEAK_FLOPS_PER_S)
                               for p in ("bfloat16", "float16", "float32")),
        memory_bandwidth_bytes_per_s=CPU_NOMINAL_MEMORY_BANDWIDTH_BYTES_PER_S,
        matmul_efficiency=1.0,
        source=f"{CPU_NOMINAL_PEAK_FLOPS_PER_S / 1e9:g} GFLOP/s per device for every precision "
               f"and {CPU_NOMINAL_MEMORY_BANDWIDTH_BYTES_PER_S / 1e9:g} GB/s memory bandwidth: "
               f"{nominal}; memory = host physical memory // {n}")
    link = LinkSpec(bandwidth_bytes_per_s=CPU_NOMINAL_LINK_BANDWIDTH_BYTES_PER_S,
                    latency_s=CPU_NOMINAL_LINK_LATENCY_S,
                    source=f"{CPU_NOMINAL_LINK_BANDWIDTH_BYTES_PER_S / 1e9:g} GB/s, "
                           f"{CPU_NOMINAL_LINK_LATENCY_S * 1e6:g} us: {nominal}")
    copy_bytes_per_s = CPU_NOMINAL_MEMORY_BANDWIDTH_BYTES_PER_S / 2
    p2p = LinkSpec(bandwidth_bytes_per_s=copy_bytes_per_s, latency_s=CPU_NOMINAL_P2P_LATENCY_S,
                   source=f"same-host memory copy: {copy_bytes_per_s / 1e9:g} GB/s = the nominal "
                          f"{CPU_NOMINAL_MEMORY_BANDWIDTH_BYTES_PER_S / 1e9:g} GB/s memory "
                          "bandwidth / 2 (each byte read and written once), "
                          f"{CPU_NOMINAL_P2P_LATENCY_S * 1e6:g} us (one op dispatch): {nominal}")
    return ClusterSpec(name=f"cpu:{n}", num_nodes=1, devices_per_node=n, device=device,
                       intra_node_link=link, intra_node_p2p_link=p2p,
                       devices_per_compute_pool=n)


def cpu_workers_cluster(workers: int, n: int) -> ClusterSpec:
    """``workers`` worker processes of ``n`` logical CPU devices each (``cpu_cluster(n)``
    per worker, nominal figures), joined by a nominal network
    (``CPU_NOMINAL_NETWORK_*``). One worker is ``cpu:n``. Device names are
    ``/job:worker/task:w/device:CPU:i`` (``ClusterSpec.device_names``): the plan
    ``plan launch --workers W`` trains with (one program per worker, ``apply.spmd``).
    """
    node = cpu_cluster(n)
    if workers == 1:
        return node
    network = LinkSpec(
        bandwidth_bytes_per_s=CPU_NOMINAL_NETWORK_BANDWIDTH_BYTES_PER_S,
        latency_s=CPU_NOMINAL_NETWORK_LATENCY_S,
        source=f"gRPC over TCP between worker processes: "
               f"{CPU_NOMINAL_NETWORK_BANDWIDTH_BYTES_PER_S / 1e9:g} GB/s, "
               f"{CPU_NOMINAL_NETWORK_LATENCY_S * 1e6:g} us: nominal figure, not measured")
    return dataclasses.replace(node, name=f"{workers}xcpu:{n}", num_nodes=workers,
                               inter_node_link=network)


def load_cluster_file(path: str) -> ClusterSpec:
    """Read a cluster file: a ClusterSpec dict, or ``{preset: NAME, nodes: N}``."""
    if not os.path.isfile(path):
        raise ClusterSpecError(
            f"Cluster file {path!r} does not exist. Give an existing .yaml/.yml/.json file, "
            f"or one of: {_forms()}.")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ClusterSpecError(f"Cluster file {path!r} cannot be read ({e}).") from e
    doc = _parse_document(path, text)
    if not isinstance(doc, Mapping):
        raise ClusterSpecError(
            f"Cluster file {path!r} holds {type(doc).__name__} {doc!r:.80}; expected a mapping "
            "with name, num_nodes, devices_per_node, device, intra_node_link (and "
            "inter_node_link for several nodes), or with `preset` and `nodes`.")
    try:
        if "preset" in doc:
            return _preset_reference(path, doc)
        doc = dict(doc)
        doc.setdefault("schema_version", SCHEMA_VERSION)
        return decode(ClusterSpec.from_dict, doc, "the cluster")
    except (SchemaError, ClusterSpecError) as e:
        raise ClusterSpecError(f"Cluster file {path!r}: {e}") from e


def _parse_document(path: str, text: str) -> Any:
    if path.lower().endswith(".json"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ClusterSpecError(f"Cluster file {path!r} is not valid JSON: {e}.") from e
    import yaml  # lazy: only cluster files need it

    class Loader(yaml.SafeLoader):
        """YAML 1.1 reads 8.1e12 and 1e9 as strings; read them as numbers (YAML 1.2)."""

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789."))
    try:
        return yaml.load(text, Loader=Loader)
    except yaml.YAMLError as e:
        raise ClusterSpecError(f"Cluster file {path!r} is not valid YAML: {e}") from e


_YAML12_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9_]+|[0-9][0-9_]*)"
                           r"(?:[eE][-+]?[0-9]+)?$")


def _preset_reference(path: str, doc: Mapping[str, Any]) -> ClusterSpec:
    extra = sorted(set(doc) - {"preset", "nodes", "schema_version"})
    if extra:
        raise ClusterSpecError(
            f"has `preset` and also {extra}; a preset reference takes only `preset` and "
            "`nodes`. Either drop those keys or write the whole cluster without `preset`.")
    preset = doc["preset"]
    if not isinstance(preset, str) or _lookup(preset) is None:
        raise ClusterSpecError(f"preset is {preset!r}; known presets: "
                               f"{', '.join(known_presets())}.")
    nodes = doc.get("nodes", 1)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ClusterSpecError(f"nodes is {nodes!r}; expected a whole number >= 1.")
    return preset_cluster(preset, nodes)


def _lookup(name: str) -> str | None:
    for known in _PRESETS:
        if known.lower() == name.lower():
            return known
    return None


def _positive_int(text: str, spec: str, what: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ClusterSpecError(f"Cluster {spec!r}: {what} is {text!r}; expected a whole number "
                               f">= 1 (e.g. cpu:4, 2xcpu:1 or 4x8xA100-80GB).")
    return int(text)


def _forms() -> str:
    return "; ".join(FORMS)
