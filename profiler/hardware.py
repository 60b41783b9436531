"""Measuring this host's devices and turning the result into a ``ClusterSpec``.

Pipeline position: the "measured" source of a ``ClusterSpec`` (beside presets,
files and ``cpu:N``, see ``planner.presets``). ``profile_hardware`` runs the
micro-benchmarks of ``profiler.hw_compute`` (matmul FLOP/s per precision,
memory bandwidth, the fixed cost of a layer) and ``profiler.hw_comm``
(point-to-point copies, TensorFlow's own all-reduce, each fitted to
alpha-beta) into a ``HardwareProfile``
(``profiler.hw_profile``); ``to_cluster_spec`` (``profiler.hw_cluster``) turns
that into the one-node cluster the planner prices strategies with;
``run_profile_hardware`` is the pair the ``plan profile-hardware`` command
calls. TensorFlow is imported only
when measuring.

Device names: ``/device:GPU:0``, ``GPU:0``, ``/job:localhost/replica:0/task:0/
device:CPU:1`` (any case). Default: every GPU this process sees, else every
logical CPU device. Naming CPU devices beyond those that exist configures that
many logical CPU devices, if TensorFlow's runtime has not started yet (as
``apply.ensure_devices`` does).
"""
from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from tfplan.core.cluster import ClusterSpec
from tfplan.core.errors import PlannerError
from tfplan.core.presets import cpu_cluster
from tfplan.profiler import hw_comm, hw_compute
from tfplan.profiler.hw_cluster import summary_rows, to_cluster_spec
from tfplan.profiler.hw_profile import AllReduceResult, HardwareProfile, MatmulResult, P2PResult
from tfplan.profiler.hw_timing import FULL, QUICK, TimingPolicy

__all__ = ["DEFAULT_PRECISIONS", "HardwareProfile", "Sizes", "default_sizes", "devices_from_arg",
           "profile_hardware", "resolve_devices", "run_profile_hardware", "summary_rows",
           "to_cluster_spec"]

Progress = Callable[[str, int, int], None]  # (stage, done, total), as profiler.static
DEFAULT_PRECISIONS = ("float32", "float16", "bfloat16")
KiB, MiB = 2**10, 2**20


@dataclass(frozen=True)
class Sizes:
    """What to measure: matmul n's, message sizes, the memory-bandwidth buffer."""

    matmul: tuple[int, ...]
    comm_bytes: tuple[int, ...]
    memory_buffer_bytes: int


def default_sizes(device_type: str, quick: bool) -> Sizes:
    """Sizes per device type. Quick: seconds on two CPU cores (tests, smoke checks).

    Full: matmuls up to where FLOP/s has levelled off (2048 on a CPU, 8192 on a
    GPU); messages 4 KiB to 64 MiB (CPU) or 256 MiB (GPU) in steps of 4x; two
    memory buffers of 128 MiB (CPU, 4x a 32 MiB L3) or 1 GiB (GPU, far above
    any L2).
    """
    if quick:
        return Sizes(matmul=(64, 128, 256), comm_bytes=(4 * KiB, 64 * KiB, MiB, 4 * MiB),
                     memory_buffer_bytes=16 * MiB)
    if device_type == "GPU":
        return Sizes(matmul=(256, 512, 1024, 2048, 4096, 8192),
                     comm_bytes=tuple(4 * KiB * 4**i for i in range(9)),
                     memory_buffer_bytes=1024 * MiB)
    return Sizes(matmul=(128, 256, 512, 1024, 2048),
                 comm_bytes=tuple(4 * KiB * 4**i for i in range(8)),
                 memory_buffer_bytes=128 * MiB)


def resolve_devices(devices: Sequence[str] | None) -> tuple[str, ...]:
    """Canonical ``/device:TYPE:i`` names of the devices to profile (see the module doc)."""
    import tensorflow as tf

    if devices is None:
        gpus = tf.config.list_logical_devices("GPU")
        found = gpus or tf.config.list_logical_devices("CPU")
        return tuple(_short(d.name) for d in found)
    if isinstance(devices, str):
        devices = [devices]
    devices = list(devices)
    if not devices:
        raise PlannerError("No devices given to profile; name at least one (e.g. GPU:0), or "
                           f"give none to profile all of them. Devices this process has: "
                           f"{_existing()}.")
    parsed = []
    for name in devices:
        m = _DEVICE_RE.fullmatch(str(name).strip())
        if m is None:
            raise PlannerError(
                f"{name!r} is not a device name; expected '/device:GPU:i', 'GPU:i' or "
                f"'CPU:i'. Devices this process has: {_existing()}.")
        parsed.append((m.group(1).upper(), int(m.group(2))))
    names = [f"/device:{t}:{i}" for t, i in parsed]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise PlannerError(f"Devices {repeated} are named more than once; name each device "
                           "once.")
    types = sorted({t for t, _ in parsed})
    if len(types) > 1:
        raise PlannerError(f"The devices {names} mix types {types}; profile one type at a time "
                           "(a cluster's devices are identical).")
    if types == ["CPU"]:
        _configure_logical_cpus(max(i for _, i in parsed) + 1)
    exist = set(_existing())
    missing = [n for n in names if n not in exist]
    if missing:
        raise PlannerError(
            f"Devices {missing} do not exist. Devices this process has: {sorted(exist)}. "
            "Name only those (e.g. --devices GPU:0,GPU:1); more logical CPU devices can only "
            "be made before TensorFlow's runtime starts.")
    return tuple(names)


def devices_from_arg(text: str | None) -> list[str] | None:
    """The CLI's ``--devices`` text as ``profile_hardware`` takes it.

    ``cpu:N`` alone means N logical CPU devices (CPU:0 .. CPU:N-1), as in
    ``--cluster cpu:N``; anything else is a comma-separated list of device names
    (``GPU:0,GPU:1``); None or empty means the default devices.
    """
    if text is None or not text.strip():
        return None
    m = re.fullmatch(r"(?i)\s*cpu:(\d+)\s*", text)
    if m:
        n = int(m.group(1))
        if n < 1:
            raise PlannerError(f"--devices {text!r}: expected cpu:N with N >= 1, or device "
                               "names such as GPU:0,GPU:1.")
        return [f"CPU:{i}" for i in range(n)]
    return [d.strip() for d in text.split(",") if d.strip()]


def profile_hardware(devices: Sequence[str] | None = None, *,
                     precisions: Sequence[str] = DEFAULT_PRECISIONS,
                     matmul_sizes: Sequence[int] | None = None,
                     comm_sizes_bytes: Sequence[int] | None = None,
                     memory_buffer_bytes: int | None = None,
                     quick: bool = False, progress: Progress | None = None) -> HardwareProfile:
    """Measure matmul FLOP/s, memory bandwidth, the fixed cost of a layer, p2p copies and
    all-reduce on ``devices``.

    Compute, memory bandwidth and the layer overhead are measured on the first device
    (a cluster's devices are identical); point-to-point copies from the first device to each
    other one (to the second only when ``quick``); the all-reduce over all of
    them. Sizes default to ``default_sizes(device_type, quick)``. A precision the
    device cannot run is skipped with a note. Raises PlannerError for bad device
    names or a broken collective.
    """
    hw_compute.check_precisions(tuple(precisions))
    names = resolve_devices(devices)
    device_type = names[0].split(":")[1]
    defaults = default_sizes(device_type, quick)
    sizes = Sizes(matmul=_sizes(matmul_sizes, defaults.matmul, "matmul_sizes"),
                  comm_bytes=_sizes(comm_sizes_bytes, defaults.comm_bytes, "comm_sizes_bytes"),
                  memory_buffer_bytes=memory_buffer_bytes or defaults.memory_buffer_bytes)
    if isinstance(sizes.memory_buffer_bytes, bool) or not isinstance(
            sizes.memory_buffer_bytes, int) or sizes.memory_buffer_bytes < 4:
        raise PlannerError(f"memory_buffer_bytes is {memory_buffer_bytes!r}; expected a whole "
                           "number of bytes, several times the last-level cache (e.g. 2**27).")
    if len(names) > 1 and len(set(sizes.comm_bytes)) < 2:
        raise PlannerError(f"comm_sizes_bytes is {list(sizes.comm_bytes)}; an alpha-beta fit "
                           "needs at least two different message sizes.")
    policy = QUICK if quick else FULL
    with _quiet_retracing_warnings():
        return _measure(names, device_type, tuple(precisions), sizes, policy, quick, progress)


def _measure(names: tuple[str, ...], device_type: str, precisions: tuple[str, ...],
             sizes: Sizes, policy: TimingPolicy, quick: bool,
             progress: Progress | None) -> HardwareProfile:
    import tensorflow as tf

    notes: list[str] = []
    matmul: list[MatmulResult] = []
    for precision in precisions:
        stage = f"matmul:{precision}"
        try:
            matmul.append(hw_compute.matmul_result(
                names[0], precision, sizes.matmul, policy, _ticker(progress, stage,
                                                                   len(sizes.matmul))))
        except (tf.errors.InvalidArgumentError, tf.errors.NotFoundError,
                tf.errors.UnimplementedError) as e:
            notes.append(f"{precision} matmul not measured: {names[0]} cannot run it "
                         f"({e.message.splitlines()[0]}).")
    if not matmul:
        raise PlannerError(f"{names[0]} ran no matmul in any of {list(precisions)}: "
                           + " ".join(notes))
    tick = _ticker(progress, "memory", 1)
    bandwidth = hw_compute.memory_bandwidth(names[0], sizes.memory_buffer_bytes, policy)
    tick()
    tick = _ticker(progress, "layer overhead", 1)
    rates = {m.precision: m.best_flops_per_s for m in matmul}
    overhead = hw_compute.layer_overhead(names[0], rates.get("float32", max(rates.values())),
                                         policy)
    tick()
    p2p: list[P2PResult] = []
    allreduce: AllReduceResult | None = None
    if len(names) > 1:
        for dst in (names[1:2] if quick else names[1:]):
            stage = f"p2p:{names[0].split('device:')[-1]}->{dst.split('device:')[-1]}"
            p2p.append(hw_comm.p2p_result(names[0], dst, sizes.comm_bytes, policy,
                                          _ticker(progress, stage, len(sizes.comm_bytes))))
        allreduce = hw_comm.allreduce_result(
            names, sizes.comm_bytes, hw_comm.hint_for(device_type), policy,
            _ticker(progress, "allreduce", len(sizes.comm_bytes)))
    else:
        notes.append("One device: no point-to-point copy or all-reduce measured.")
    memory_bytes, memory_source = _memory_per_device(names)
    notes.extend(_device_notes(device_type, len(names)))
    return HardwareProfile(
        device_type=device_type, device_kind=_device_kind(device_type), devices=names,
        memory_bytes_per_device=memory_bytes, memory_source=memory_source,
        matmul=tuple(matmul), memory_bandwidth=bandwidth, p2p=tuple(p2p), allreduce=allreduce,
        layer_overhead=overhead, tensorflow_version=tf.__version__, quick=quick,
        notes=tuple(notes))


def run_profile_hardware(devices: list[str] | None, quick: bool,
                         progress: Progress | None) -> tuple[HardwareProfile, ClusterSpec]:
    """What ``plan profile-hardware`` calls: the profile and its ClusterSpec."""
    hw = profile_hardware(devices, quick=quick, progress=progress)
    return hw, to_cluster_spec(hw)


# --- helpers --------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet_retracing_warnings():
    """Every measured point is a new tf.function, by design; TensorFlow warns about
    "excessive retracing" after five. Raise its logger to ERROR meanwhile."""
    import tensorflow as tf

    logger = tf.get_logger()
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


_DEVICE_RE = re.compile(r"(?i)(?:/job:localhost/replica:0/task:0)?/?(?:device:)?(CPU|GPU):(\d+)")


def _short(name: str) -> str:
    m = re.search(r"(?i)device:(CPU|GPU):(\d+)$", name)
    return f"/device:{m.group(1).upper()}:{m.group(2)}" if m else name


def _existing() -> list[str]:
    import tensorflow as tf

    return [_short(d.name) for d in tf.config.list_logical_devices()]


def _configure_logical_cpus(need: int) -> None:
    import tensorflow as tf

    physical = tf.config.list_physical_devices("CPU")
    configured = tf.config.get_logical_device_configuration(physical[0])
    if (len(configured) if configured else 1) >= need:
        return
    try:
        tf.config.set_logical_device_configuration(
            physical[0], [tf.config.LogicalDeviceConfiguration() for _ in range(need)])
    except RuntimeError:  # the runtime has started: resolve_devices reports what exists
        pass


def _sizes(given: Sequence[int] | None, default: tuple[int, ...], what: str) -> tuple[int, ...]:
    if given is None:
        return default
    values = tuple(given)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise PlannerError(f"{what} is {list(values)}; expected positive whole numbers.")
    return values


def _ticker(progress: Progress | None, stage: str, total: int) -> Callable[[], None]:
    done = [0]
    if progress is not None:
        progress(stage, 0, total)

    def tick() -> None:
        done[0] += 1
        if progress is not None:
            progress(stage, done[0], total)
    return tick


def _device_kind(device_type: str) -> str:
    import tensorflow as tf

    if device_type == "GPU":
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            return str(tf.config.experimental.get_device_details(gpus[0]).get(
                "device_name", "GPU"))
        return "GPU"
    return "CPU"


def _memory_per_device(names: tuple[str, ...]) -> tuple[int, str]:
    if names[0].startswith("/device:CPU"):
        n = len(names)
        return (cpu_cluster(n).device.memory_bytes,
                f"host physical memory // {n} (as planner.presets.cpu_cluster): the logical "
                "CPU devices share it")
    from tfplan.compat import local_devices  # the one API that reports GPU capacity

    limits = {_short(d.name): d.memory_limit_bytes for d in local_devices()}
    known = [limits[n] for n in names if limits.get(n)]
    if len(known) != len(names):
        raise PlannerError(
            f"TensorFlow reports no memory limit for some of {list(names)} (it knows "
            f"{sorted(limits)}). Write the cluster by hand instead (a cluster file with "
            "device.memory_bytes; see `plan clusters --json`).")
    return (min(known), "TensorFlow's allocator limit per GPU (device_lib memory_limit, the "
                        "memory TensorFlow may use, below the card's total); smallest of the "
                        "devices")


def _device_notes(device_type: str, n: int) -> list[str]:
    import tensorflow as tf

    if device_type == "CPU":
        return [f"Logical CPU devices share one thread pool and the host's memory: FLOP/s and "
                f"memory bandwidth were measured on one device with the others idle; {n} "
                "devices working at once share them, so CPU timings cannot show multi-device "
                "speed-ups. Point-to-point copies between logical CPU devices hand over a "
                "shared buffer: no bytes move."]
    tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    return [f"float32 matmuls ran with TensorFloat-32 {'enabled' if tf32 else 'disabled'} "
            "(tf.config.experimental.enable_tensor_float_32_execution), as TensorFlow will "
            "train."]
