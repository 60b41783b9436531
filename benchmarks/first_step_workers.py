"""How long a job takes to start with one program per worker, for 1, 2 and 4 workers (issue 26).

Each worker of ``plan launch --workers W`` (W = 1: one process, a one-host plan) builds the
tiny transformer of tests/apply under a plan with the same shape on every worker: tensor
parallel over its C logical CPUs (tp = C), data parallel across the workers (dp = W), and
times, on its own devices: ``apply.wrap`` (each device's copy built), the first
``train_on_batch`` (the step traced, the collective groups set up, one step run) and the
median of the next 3 steps. ``first - step`` is the start-up: tracing plus group set-up.

Every worker traces only its own C devices' part of the step, so the start-up should not
grow with W (and grow at most linearly with C). On a machine with fewer cores than
workers x devices the workers share cores, so wall times there grow with W for that reason
alone; the CPU time each worker's process spends in its first step (``first_step_cpu_s``:
tracing its part of the step, setting up its groups) is the measure that does not depend
on how many cores the workers share.

    .venv/bin/python benchmarks/first_step_workers.py [--workers 1 2 4] [--cpus 2] [--json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

GLOBAL_BATCH = 16
SPLITS = (("embed", "vocab"), ("attention", "heads"), ("mlp_up", "column"),
          ("mlp_down", "row"), ("logits", "column"))


def make_plan(workers: int, cpus: int):
    """dp = workers x tp = cpus; worker w's CPUs hold replica w's tensor ranks."""
    from tests.apply.helpers import base_model, make_plan as hand_plan

    _, model = base_model("tiny_transformer")
    if workers == 1:
        devices = [f"/device:CPU:{i}" for i in range(cpus)]
    else:
        devices = [f"/job:worker/task:{w}/device:CPU:{i}" for w in range(workers)
                   for i in range(cpus)]
    plan = hand_plan(model, [devices], global_batch=GLOBAL_BATCH)
    plan = dataclasses.replace(plan, tp_splits=SPLITS, strategy=dataclasses.replace(
        plan.strategy, dp=workers, tp=cpus, microbatch_size=GLOBAL_BATCH // workers))
    if workers > 1:
        one = plan.cluster
        plan = dataclasses.replace(plan, cluster=dataclasses.replace(
            one, name=f"{workers}xcpu:{cpus}", num_nodes=workers, devices_per_node=cpus,
            inter_node_link=one.intra_node_link))
    return dataclasses.replace(plan, name=f"dp{workers} x tp{cpus}")


def worker(plan_path: str, out_dir: str) -> None:
    """One worker: time wrap, the first step and the next ones; write worker{task}.json."""
    from tfplan import apply
    from tfplan.planner.plan import load_plan
    from tests.apply.helpers import base_model, batches_of, fresh_optimizer

    plan = load_plan(plan_path)
    apply.ensure_devices(plan)
    task = json.loads(os.environ.get("TF_CONFIG", '{"task": {"index": 0}}'))["task"]["index"]
    module, model = base_model("tiny_transformer")
    start = time.perf_counter()
    wrapped = apply.wrap(model, plan)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    built = time.perf_counter()
    batches = batches_of(module, 4, GLOBAL_BATCH)
    cpu = time.process_time()
    wrapped.train_on_batch(*batches[0])
    first = time.perf_counter()
    first_cpu = time.process_time() - cpu
    steps = []
    for x, y in batches[1:]:
        t = time.perf_counter()
        wrapped.train_on_batch(x, y)
        steps.append(time.perf_counter() - t)
    result = {"task": task, "wrap_s": round(built - start, 3),
              "first_step_s": round(first - built, 3), "first_step_cpu_s": round(first_cpu, 3),
              "step_s": round(statistics.median(steps), 4)}
    with open(os.path.join(out_dir, f"worker{task}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)


def run(workers: int, cpus: int) -> list[dict]:
    """One launch: every worker's timings."""
    from tfplan.planner.plan import save_plan

    with tempfile.TemporaryDirectory() as out:
        plan_path = os.path.join(out, "plan.json")
        save_plan(make_plan(workers, cpus), plan_path)
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=ROOT)
        me = os.path.abspath(__file__)
        if workers == 1:
            command = [sys.executable, me, "--worker", plan_path, out]
        else:
            command = [sys.executable, "-m", "tfplan.cli", "launch", "--workers",
                       str(workers), me, "--worker", plan_path, out]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=900)
        if done.returncode != 0:
            raise SystemExit(f"{workers} worker(s) failed:\n{done.stderr[-4000:]}")
        return [json.load(open(os.path.join(out, f"worker{w}.json"), encoding="utf-8"))
                for w in range(workers)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--cpus", type=int, default=2, help="logical CPUs per worker")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    rows = []
    for w in args.workers:
        got = run(w, args.cpus)
        rows.append({"workers": w, "cpus_per_worker": args.cpus, "plan": f"dp{w} x tp{args.cpus}",
                     "wrap_s": max(r["wrap_s"] for r in got),
                     "first_step_s": max(r["first_step_s"] for r in got),
                     "step_s": max(r["step_s"] for r in got),
                     "startup_s": round(max(r["first_step_s"] - r["step_s"] for r in got), 3),
                     "first_step_cpu_s": max(r["first_step_cpu_s"] for r in got)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'workers':>7} {'plan':>10} {'wrap s':>7} {'first step s':>12} {'step s':>7} "
          f"{'start-up s':>10} {'first step CPU s/worker':>23}")
    for r in rows:
        print(f"{r['workers']:>7} {r['plan']:>10} {r['wrap_s']:>7.2f} {r['first_step_s']:>12.2f} "
              f"{r['step_s']:>7.3f} {r['startup_s']:>10.2f} {r['first_step_cpu_s']:>23.2f}")


if __name__ == "__main__":
    main()
