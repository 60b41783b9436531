"""Hardware profile of this host's logical CPU devices, beside the nominal ``cpu:N`` figures.

Pipeline position: a benchmark outside the pipeline that runs
``profiler.hardware.run_profile_hardware`` (the ``plan profile-hardware``
library call) for N logical CPU devices, N = 2 and 4 by default, each in its
own process (logical devices can only be made before TensorFlow's runtime
starts), prints the measured table and the resulting ClusterSpec next to
``planner.presets.cpu_cluster(N)``'s nominal figures, and writes
``OUT/hardware-cpuN.json`` (the HardwareProfile) and ``OUT/cluster-cpuN.json``
(the ClusterSpec, usable as ``plan analyze --cluster OUT/cluster-cpuN.json``).

    python benchmarks/hardware_cpu.py [--devices 2,4] [--quick] [--out out/hardware]

On a GPU host the same library call measures the GPUs (``--gpu``). Full runs
take about 65 s (N = 2) and 90 s (N = 4) on this 2-core host; ``--quick``
about 4 s each. Logical CPU devices share one thread pool and the host's
memory (DESIGN.md): the compute and bandwidth figures are the host's, measured
on one device with the others idle.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="2,4", help="logical CPU device counts, e.g. 2,4")
    ap.add_argument("--quick", action="store_true", help="small sizes: seconds, not minutes")
    ap.add_argument("--gpu", action="store_true", help="profile this host's GPUs instead")
    ap.add_argument("--out", default="out/hardware")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.child is not None or args.gpu:
        return _profile(args.child, args.quick, args.out)
    status = 0
    for n in (int(x) for x in args.devices.split(",")):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", str(n), "--out", args.out]
        status |= subprocess.call(cmd + (["--quick"] if args.quick else []))
    return status


def _profile(n: int | None, quick: bool, out: str) -> int:
    from tfplan.profiler.tf_runtime import import_tensorflow

    tf = import_tensorflow()
    if n is not None:
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    elif not tf.config.list_physical_devices("GPU"):
        print("--gpu: this host has no GPU.", file=sys.stderr)
        return 2
    from tfplan.core.presets import cpu_cluster
    from tfplan.profiler.hardware import run_profile_hardware, summary_rows

    start = time.perf_counter()

    def progress(stage: str, done: int, total: int) -> None:
        if done == total:
            print(f"  {stage} done at {time.perf_counter() - start:.1f} s", file=sys.stderr)

    devices = None if n is None else [f"CPU:{i}" for i in range(n)]
    hw, cluster = run_profile_hardware(devices, quick, progress)
    label = f"cpu{n}" if n is not None else "gpu"
    print(f"\n== {len(hw.devices)} x {hw.device_kind}{' (quick)' if quick else ''}: "
          f"{time.perf_counter() - start:.1f} s ==")
    rows = summary_rows(hw, cluster)
    width = max(len(r[0]) for r in rows)
    for what, value, detail in rows:
        print(f"{what:<{width}}  {value:<34}  {detail}")
    if n is not None:
        nominal = cpu_cluster(n)
        print(f"{'nominal cpu:' + str(n):<{width}}  "
              f"{nominal.device.peak_flops('float32') / 1e9:g} GFLOP/s, "
              f"{nominal.device.memory_bandwidth_bytes_per_s / 1e9:g} GB/s memory, link "
              f"{nominal.intra_node_link.bandwidth_bytes_per_s / 1e9:g} GB/s + "
              f"{nominal.intra_node_link.latency_s * 1e6:g} us, p2p link "
              f"{nominal.intra_node_p2p_link.bandwidth_bytes_per_s / 1e9:g} GB/s + "
              f"{nominal.intra_node_p2p_link.latency_s * 1e6:g} us")
    for note in hw.notes:
        print(f"note: {note}")
    for name, doc in ((f"hardware-{label}.json", hw.to_dict()),
                      (f"cluster-{label}.json", cluster.to_dict())):
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
