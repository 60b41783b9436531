"""Predicted against measured step time on this host's logical CPUs (issue 4 acceptance).

Pipeline position: a benchmark over the whole pipeline. (1) Calibrate: run
``plan profile-hardware --devices cpu:4 --out OUT/cluster-cpu4.json`` (a
subprocess, so the four logical devices are made fresh). (2) Plan: profile
each example model (``profiler.static.profile_source``, as ``plan analyze``
does) and price fixed strategies on the measured cluster with
``planner.search.search(profile, cluster, B, fix=...)``: one device
(``dp=1``), data parallel (``dp=4``), pipelines (``pp=2``, ``pp=4``); a fix
the model cannot take (pp=4 on a 3-layer MLP) is reported and skipped.
(3) Measure: train each plan with ``apply.wrap`` in its own subprocess (fresh
logical devices), as ``examples/train.py`` does -- load the plan,
``apply.ensure_devices``, build, wrap, compile, ``train_on_batch`` on one
fixed batch of the global size -- discarding ``--warmup`` steps (the first
traces) and taking the median of ``--steps`` timed steps. (4) Print, per
plan: predicted and measured step time, their ratio, whether within 20%, and
the predicted breakdown (compute / communication / bubble / recompute /
optimizer) so a gap can be located; ``--json`` prints one JSON object instead.
Exit code 0 whatever the ratios; the last line says "N of M within 20%".

    python benchmarks/cpu_calibration.py [--out out/calibration] [--cluster FILE]
        [--quick] [--steps 20] [--warmup 5] [--models mlp,cnn] [--layers] [--json]

``--cluster FILE`` skips the calibration and uses that cluster file;
``--quick`` calibrates with ``--quick`` and times fewer steps (a smoke check,
not a calibration). ``--layers`` also measures each model's per-layer times
(``plan profile MODEL --measure --batch-size B --json``, XProf) at the batch
one device sees in the single-device plan and prints them beside the cost
model's per-layer prediction (``planner.cost_model.layer_pass_time_s``).

Global batches are chosen so that a step takes tens of milliseconds or more
on this 2-core host (Keras' per-step overhead, ~1-3 ms, would otherwise
dominate): MLP 65536 (2.7 GFLOP per step), CNN 1024 (2.4 GFLOP per step).
The whole run takes about 4 minutes here (calibration ~90 s).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DEVICES = 4
TOLERANCE = 0.20  # |predicted / measured - 1| <= 20%
MODELS = {  # name: (model file, global batch)
    "mlp": ("examples/mlp.py", 65536),
    "cnn": ("examples/cnn.py", 1024),
}
FIXES = (("dp=1", {"dp": 1}), ("dp=4", {"dp": 4}), ("pp=2", {"pp": 2}), ("pp=4", {"pp": 4}))
BREAKDOWN = ("compute_s", "communication_s", "bubble_s", "recompute_s", "optimizer_s")


@dataclass
class Row:
    model: str
    fix: str
    global_batch: int
    plan: str = ""
    predicted_s: float | None = None  # the plan trained (calibrated when measured times exist)
    predicted_roofline_s: float | None = None  # same fix, layers priced by roofline
    measured_s: float | None = None
    breakdown: dict[str, float] | None = None
    step_times_s: list[float] | None = None
    load_average: float | None = None  # host 1-minute load average after training
    skipped: str = ""

    @property
    def ratio(self) -> float | None:
        if self.predicted_s is None or not self.measured_s:
            return None
        return self.predicted_s / self.measured_s

    @property
    def within(self) -> bool | None:
        r = self.ratio
        return None if r is None else abs(r - 1) <= TOLERANCE

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "fix": self.fix, "global_batch": self.global_batch,
                "plan": self.plan, "predicted_step_time_s": self.predicted_s,
                "predicted_roofline_step_time_s": self.predicted_roofline_s,
                "roofline_ratio": (None if self.predicted_roofline_s is None
                                   or not self.measured_s
                                   else self.predicted_roofline_s / self.measured_s),
                "measured_step_time_s": self.measured_s, "ratio": self.ratio,
                "within_20_percent": self.within, "predicted_breakdown": self.breakdown,
                "measured_step_times_s": self.step_times_s, "load_average": self.load_average,
                "skipped": self.skipped or None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/calibration")
    ap.add_argument("--cluster", help="a cluster file: skip the calibration")
    ap.add_argument("--quick", action="store_true", help="quick calibration, fewer steps")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per plan (default 20)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    ap.add_argument("--models", default=",".join(MODELS), help="mlp,cnn")
    ap.add_argument("--layers", action="store_true",
                    help="also compare measured and predicted per-layer times")
    ap.add_argument("--roofline-only", action="store_true",
                    help="do not calibrate the layers with a one-device measurement; predict "
                         "from FLOPs and bytes only")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--child-train", nargs=4, metavar=("PLAN", "MODEL", "BATCH", "STEPS"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_train:
        plan, model, batch, steps = args.child_train
        return _child_train(plan, model, int(batch), int(steps), args.warmup)
    if args.quick:
        args.steps, args.warmup = min(args.steps, 5), min(args.warmup, 2)
    os.makedirs(args.out, exist_ok=True)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True))
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        ap.error(f"--models: unknown {unknown}; expected some of {sorted(MODELS)}")

    start = time.perf_counter()
    cluster_path = args.cluster or _calibrate(args.out, args.quick, log)
    from tfplan.profiler.tf_runtime import import_tensorflow

    import_tensorflow()
    from tfplan.core.presets import load_cluster_file

    cluster = load_cluster_file(cluster_path)
    rows: list[Row] = []
    layer_tables: dict[str, list[dict[str, Any]]] = {}
    for name in models:
        path, batch = MODELS[name]
        profile = _profile(path)
        measured = None
        if not args.roofline_only or args.layers:
            measured = _measure_layers(path, batch, args.out, log)
        calibrated = profile
        if measured is not None and not args.roofline_only:
            from tfplan.profiler.calibrate import with_measured_times
            calibrated = with_measured_times(profile, measured)
        for label, fix in FIXES:
            row = Row(model=name, fix=label, global_batch=batch)
            rows.append(row)
            if calibrated is not profile:
                roofline = Row(model=name, fix=label, global_batch=batch)
                _plan(profile, cluster, batch, fix, label, name + "-roofline", args.out,
                      roofline)
                row.predicted_roofline_s = roofline.predicted_s
            plan_path = _plan(calibrated, cluster, batch, fix, label, name, args.out, row)
            if plan_path is None:
                log(f"{name} {label}: skipped ({row.skipped})")
                continue
            log(f"{name} {label}: training {row.plan} ...")
            _measure(plan_path, path, batch, args, row)
            log(f"  predicted {_ms(row.predicted_s)} ms, measured {_ms(row.measured_s)} ms"
                + (f" ({row.skipped})" if row.skipped else ""))
        if args.layers and measured is not None:
            layer_tables[name] = _layer_comparison(measured, profile, cluster)
    elapsed = time.perf_counter() - start
    judged = [r for r in rows if r.within is not None]
    summary = f"{sum(r.within for r in judged)} of {len(judged)} within 20%"
    if args.json:
        print(json.dumps({"cluster": cluster.to_dict(), "cluster_file": cluster_path,
                          "rows": [r.to_dict() for r in rows], "layers": layer_tables or None,
                          "summary": summary, "elapsed_s": elapsed}, indent=1))
        return 0
    _print_table(rows, cluster)
    for name, table in layer_tables.items():
        _print_layers(name, table)
    busy = [r.load_average for r in rows if r.load_average is not None]
    if busy and max(busy) > (os.cpu_count() or 1):
        print(f"\nwarning: the host's load average reached {max(busy):.1f} on {os.cpu_count()} "
              "cores while measuring: other work shared the cores, so the measured times (and "
              "a calibration made meanwhile) are perturbed; re-run on a quiet host.")
    print(f"\n{summary}  ({elapsed:.0f} s; cluster {cluster_path})")
    return 0


# --- (1) calibration ----------------------------------------------------------------------
def _calibrate(out: str, quick: bool, log) -> str:
    path = os.path.join(out, f"cluster-cpu{DEVICES}.json")
    cmd = [sys.executable, "-m", "tfplan.cli", "profile-hardware", "--devices",
           f"cpu:{DEVICES}", "--out", path, "--json"] + (["--quick"] if quick else [])
    log(f"calibrating: plan profile-hardware --devices cpu:{DEVICES}{' --quick' if quick else ''}")
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"plan profile-hardware failed ({r.returncode}):\n{r.stderr[-3000:]}")
    with open(os.path.join(out, f"hardware-cpu{DEVICES}.json"), "w", encoding="utf-8") as f:
        json.dump(json.loads(r.stdout)["hardware"], f, indent=1)
    log(f"  wrote {path} in {time.perf_counter() - t:.0f} s")
    return path


# --- (2) plans ----------------------------------------------------------------------------
def _profile(path: str):
    from tfplan.profiler.loader import load_model_source
    from tfplan.profiler.static import profile_source

    return profile_source(load_model_source(os.path.join(ROOT, path)), batch_size=1)


def _plan(profile, cluster, batch: int, fix: dict[str, int], label: str, name: str, out: str,
          row: Row) -> str | None:
    from tfplan.core.errors import PlannerError
    from tfplan.planner.plan import save_plan
    from tfplan.planner.search import search

    try:
        plan = search(profile, cluster, batch, fix=fix).chosen
    except PlannerError as e:
        row.skipped = str(e).split(". ")[0]
        return None
    row.plan = plan.name
    row.predicted_s = plan.predicted.step_time_s
    row.breakdown = plan.predicted.breakdown.to_dict()
    path = os.path.join(out, f"plan-{name}-{label.replace('=', '')}.json")
    save_plan(plan, path)
    return path


# --- (3) measurement ------------------------------------------------------------------------
def _measure(plan_path: str, model_path: str, batch: int, args, row: Row) -> None:
    cmd = [sys.executable, os.path.abspath(__file__), "--warmup", str(args.warmup),
           "--child-train", plan_path, os.path.join(ROOT, model_path), str(batch),
           str(args.steps)]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if r.returncode != 0:
        row.skipped = f"training failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:]}"
        return
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    row.step_times_s = doc["step_times_s"]
    row.measured_s = statistics.median(doc["step_times_s"])
    row.load_average = os.getloadavg()[0]


def _child_train(plan_path: str, model_path: str, batch: int, steps: int, warmup: int) -> int:
    """One plan, as examples/train.py trains it, with each step timed."""
    from tfplan.profiler.tf_runtime import import_tensorflow

    import_tensorflow()
    from tfplan import apply
    from tfplan.planner.plan import load_plan

    plan = load_plan(plan_path)
    apply.ensure_devices(plan)  # before TensorFlow's runtime starts
    import keras

    train = _examples_train()
    keras.utils.set_random_seed(0)
    source, build_model = train._load_source(model_path)
    model = apply.wrap(build_model(), plan)
    model.compile(optimizer=train._optimizer(source.optimizer), loss=source.loss)
    x, y = source.sample_batch(batch)
    times = []
    for _ in range(warmup + steps):
        t = time.perf_counter()
        logs = model.train_on_batch(x, y, return_dict=True)
        float(logs["loss"])  # the step has finished
        times.append(time.perf_counter() - t)
    print(json.dumps({"plan": plan.name, "step_times_s": times[warmup:],
                      "warmup_times_s": times[:warmup]}))
    return 0


def _examples_train():
    spec = importlib.util.spec_from_file_location("examples_train",
                                                  os.path.join(ROOT, "examples", "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- per-layer comparison --------------------------------------------------------------------
def _measure_layers(model_path: str, batch: int, out: str, log):
    """Per-layer times of the model on one logical device at ``batch`` (XProf, through
    ``plan profile --measure --json``, saved as OUT/measured-MODEL.json): the
    calibration ``plan analyze --measured`` uses."""
    from tfplan.profiler.measured_profile import MeasuredProfile

    name = os.path.basename(model_path)[:-3]
    log(f"measuring per-layer times of {model_path} at batch {batch} on one device ...")
    cmd = [sys.executable, "-m", "tfplan.cli", "profile", os.path.join(ROOT, model_path),
           "--measure", "--batch-size", str(batch), "--json", "--logdir",
           os.path.join(os.path.abspath(out), "xprof-" + name)]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if r.returncode != 0:
        log(f"  plan profile --measure failed ({r.returncode}): {r.stderr[-500:]}")
        return None
    with open(os.path.join(out, f"measured-{name}.json"), "w", encoding="utf-8") as f:
        f.write(r.stdout)
    return MeasuredProfile.from_dict(json.loads(r.stdout)["measured"])


def _layer_comparison(measured, profile, cluster) -> list[dict[str, Any]]:
    """Measured (XProf, `plan profile --measure`) against roofline per-layer times."""
    from tfplan.planner import cost_model as cm

    batch = measured.batch_size
    times = {m.name: m for m in measured.layers}
    table = []
    for layer in profile.layers:
        m = times.get(layer.name)
        predicted = cm.layer_pass_time_s(layer, batch, profile.batch_size, cluster.device,
                                         profile.precision)
        table.append({"layer": layer.name, "type": layer.type, "predicted_s": predicted,
                      "measured_s": None if m is None else m.time_s,
                      "flops": (layer.flops_fwd + layer.flops_bwd) * batch / profile.batch_size})
    return table


# --- display --------------------------------------------------------------------------------
def _print_table(rows: list[Row], cluster) -> None:
    d = cluster.device
    p2p = cluster.p2p_link(True)
    print(f"\ncluster {cluster.name}: float32 {d.achieved_flops('float32') / 1e9:.3g} GFLOP/s, "
          f"memory {d.memory_bandwidth_bytes_per_s / 1e9:.3g} GB/s, layer overhead "
          f"{'-' if d.layer_overhead_s is None else f'{d.layer_overhead_s * 1e6:.3g} us'}, "
          f"all-reduce link {cluster.intra_node_link.bandwidth_bytes_per_s / 1e9:.3g} GB/s + "
          f"{cluster.intra_node_link.latency_s * 1e6:.3g} us/step, p2p link "
          f"{p2p.bandwidth_bytes_per_s / 1e9:.3g} GB/s + {p2p.latency_s * 1e6:.3g} us, "
          f"{cluster.devices_per_compute_pool} device(s) per compute pool")
    head = ("model", "fix", "batch", "plan", "predicted ms", "measured ms", "ratio", "<=20%",
            "roofline ms", "ratio", "compute", "comm", "bubble", "recomp", "optim", "load")
    lines = [head]
    for r in rows:
        b = r.breakdown or {}
        lines.append((r.model, r.fix, str(r.global_batch), r.plan or r.skipped[:40],
                      _ms(r.predicted_s), _ms(r.measured_s),
                      "-" if r.ratio is None else f"{r.ratio:.2f}",
                      "-" if r.within is None else ("yes" if r.within else "NO"),
                      _ms(r.predicted_roofline_s),
                      "-" if r.predicted_roofline_s is None or not r.measured_s
                      else f"{r.predicted_roofline_s / r.measured_s:.2f}",
                      *(_ms(b.get(k)) for k in BREAKDOWN),
                      "-" if r.load_average is None else f"{r.load_average:.1f}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    print(f"predicted breakdown columns in ms; load = the host's 1-minute load average after "
          f"training ({os.cpu_count()} cores: other work on the host slows the measurement)")
    for line in lines:
        print("  ".join(c.ljust(w) if i < 4 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(line, widths))))


def _print_layers(name: str, table: list[dict[str, Any]]) -> None:
    print(f"\n{name}: per-layer forward+backward, predicted vs measured (XProf)")
    print(f"{'layer':<10} {'type':<24} {'MFLOP':>9} {'pred ms':>9} {'meas ms':>9} {'ratio':>6}")
    for t in table:
        ratio = (f"{t['predicted_s'] / t['measured_s']:.2f}" if t["measured_s"] else "-")
        print(f"{t['layer']:<10} {t['type']:<24} {t['flops'] / 1e6:>9.1f} "
              f"{_ms(t['predicted_s']):>9} {_ms(t['measured_s']):>9} {ratio:>6}")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3g}"


def _env() -> dict[str, str]:
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)


if __name__ == "__main__":
    sys.exit(main())
