"""Hybrid plans across two local worker processes (``apply.multi_worker_hybrid``).

``plan launch --workers 2`` starts this file as a script on two workers (TF_CONFIG on
127.0.0.1, 2 logical CPUs each); each worker wraps the tiny models with hand-made
plans over ``/job:worker/task:{0,1}/device:CPU:{0,1}`` (a ``2xcpu:2`` cluster, data
parallel between the workers, the rest inside each) and trains them; the test
process trains the same models on one device. Losses of 10 ``train_on_batch`` steps
must agree within 1e-4 (relative), and every variable and optimizer slot must sit on
the device the plan names for this worker's replicas.

Cases (name: model, plan): dp2xpp2 (a 2-stage pipeline on each worker, 2
micro-batches; GPipe for the MLP, 1F1B order for the others), dp2xtp2 (the model's
Megatron splits over each worker's 2 CPUs), dp4 (two replicas per worker, four in all)
and dp2 (plain data parallel, one CPU per worker: ``apply.multi_worker``, in the same
processes); the MLP's dp2xpp2 also runs ``fit``, ``evaluate``, ``predict`` and
``save_weights``/``load_weights``; ``+clip``: the MLP's dp2 and dp4 with an SGD that
clips by ``global_clipnorm`` every step (``apply.clipping``); ``+zero1``: ZeRO-1 over
the whole job (``apply.zero_workers``) for the MLP's dp2 and dp4 and the transformer's
dp2 x tp2; the tiny ResNet's BatchNormalization layers with global statistics in dp2,
dp4 and dp2xpp2 (equal to one device: ``apply.batch_stats``).

The default run launches ``DEFAULT_CASES``, one case per feature (each plan shape, the
1F1B order, clipping and ZeRO-1 in both multi-worker modes, BatchNormalization over
workers and micro-batches); ``SLOW_CASES`` (``-m slow``) are the other models' repeats of
those shapes.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

if __name__ == "__main__":  # a worker: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))

from tests.apply.helpers import (HERE, base_model, batches_of, fresh_optimizer,  # noqa: E402
                                 make_plan, single_device_copy, step_losses)

ROOT = os.path.dirname(os.path.dirname(HERE))
WORKERS, CPUS = 2, 2
STEPS = 10
GLOBAL_BATCH = 16
SPLITS = {
    "tiny_mlp": (("dense_in", "column"), ("hidden", "row"), ("narrow", "column"),
                 ("head", "row")),
    "tiny_transformer": (("embed", "vocab"), ("attention", "heads"), ("mlp_up", "column"),
                         ("mlp_down", "row"), ("logits", "column")),
    "tiny_cnn": (("stem", "row"), ("res_a", "column"), ("res_b", "row"),
                 ("classifier", "column")),
}
CASES = [("tiny_mlp", "dp2xpp2"), ("tiny_mlp", "dp2xtp2"), ("tiny_mlp", "dp4"),
         ("tiny_transformer", "dp2xpp2"), ("tiny_transformer", "dp2xtp2"),
         ("tiny_transformer", "dp2"), ("tiny_cnn", "dp2xpp2"), ("tiny_cnn", "dp2xtp2"),
         ("tiny_cnn", "dp2"), ("tiny_mlp", "dp2+clip"), ("tiny_mlp", "dp4+clip"),
         ("tiny_mlp", "dp2+zero1"), ("tiny_mlp", "dp4+zero1"),
         ("tiny_transformer", "dp2xtp2+zero1"),
         # BatchNormalization, global statistics (apply.batch_stats): all-reduced between the
         # workers' MirroredStrategy replicas (dp2), also over each worker's two copies (dp4),
         # and over each worker's two micro-batches of a pipeline (dp2xpp2)
         ("tiny_resnet_bn", "dp2"), ("tiny_resnet_bn", "dp4"), ("tiny_resnet_bn", "dp2xpp2")]
# one case per feature, launched by default; the first also runs fit/evaluate/predict/files
DEFAULT_CASES = [("tiny_mlp", "dp2xpp2"), ("tiny_transformer", "dp2xpp2"), ("tiny_mlp", "dp4"),
                 ("tiny_transformer", "dp2xtp2"), ("tiny_transformer", "dp2"),
                 ("tiny_mlp", "dp2+clip"), ("tiny_mlp", "dp4+clip"), ("tiny_mlp", "dp4+zero1"),
                 ("tiny_transformer", "dp2xtp2+zero1"), ("tiny_resnet_bn", "dp2"),
                 ("tiny_resnet_bn", "dp2xpp2")]
# the rest (-m slow), with the MLP's dp4 again for its dp2+zero1's slot count
SLOW_CASES = [c for c in CASES if c not in DEFAULT_CASES] + [("tiny_mlp", "dp4")]
assert set(DEFAULT_CASES) | set(SLOW_CASES) == set(CASES)
SCHEDULE = {"tiny_mlp": "gpipe", "tiny_transformer": "1f1b", "tiny_cnn": "1f1b",
            "tiny_resnet_bn": "gpipe"}
MODE = {"dp2": "MultiWorkerModel", "dp2+clip": "MultiWorkerModel"}  # apply.multi_worker
CLIP_NORM = 0.5  # "+clip": SGD with global_clipnorm, below the MLP's gradient norms (~3)


def optimizer_for(module, kind: str):
    """The case's optimizer: the model file's, or (``+clip``) SGD that clips every step
    (apply.clipping; Adam would hide a wrong clip: its steps ignore gradient scale)."""
    import keras

    if kind.endswith("+clip"):
        return keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=CLIP_NORM)
    return fresh_optimizer(module)


def dev(task: int, cpu: int) -> str:
    return f"/job:worker/task:{task}/device:CPU:{cpu}"


def worker_plan(model, name: str, kind: str):
    """A plan for ``2xcpu:2``, data parallel across the workers (dp-outer layout)."""
    zero = kind.endswith("+zero1")  # ZeRO-1 over the job (apply.zero_workers)
    kind = kind.removesuffix("+clip").removesuffix("+zero1")
    if kind == "dp2xpp2":  # stage s of replica w on worker w's CPU s
        stages = [[dev(0, s), dev(1, s)] for s in range(CPUS)]
        plan = make_plan(model, stages, num_microbatches=2, global_batch=GLOBAL_BATCH)
        plan = dataclasses.replace(plan, strategy=dataclasses.replace(  # dp outermost;
            plan.strategy, layout="tp-pp-dp", schedule=SCHEDULE[name]))  # apply.schedule
    elif kind == "dp2":  # plain data parallel, worker w's CPU 0 (apply.multi_worker)
        plan = make_plan(model, [[dev(w, 0) for w in range(WORKERS)]], global_batch=GLOBAL_BATCH)
    elif kind == "dp4":  # replica 2w + i on worker w's CPU i
        plan = make_plan(model, [[dev(w, i) for w in range(WORKERS) for i in range(CPUS)]],
                         global_batch=GLOBAL_BATCH)
    else:  # dp2xtp2: replica w's tp ranks on worker w's CPUs
        plan = make_plan(model, [[dev(w, i) for w in range(WORKERS) for i in range(CPUS)]],
                         global_batch=GLOBAL_BATCH)
        strategy = dataclasses.replace(plan.strategy, dp=WORKERS, tp=CPUS,
                                       microbatch_size=GLOBAL_BATCH // WORKERS)
        plan = dataclasses.replace(plan, strategy=strategy, tp_splits=SPLITS[name])
    one = plan.cluster
    cluster = dataclasses.replace(one, name=f"{WORKERS}xcpu:{CPUS}", num_nodes=WORKERS,
                                  devices_per_node=CPUS, inter_node_link=one.intra_node_link)
    plan = dataclasses.replace(plan, strategy=dataclasses.replace(
        plan.strategy, zero_stage=int(zero)))
    return dataclasses.replace(plan, cluster=cluster, name=f"{name} {kind}{'+zero1' * zero} "
                               "over 2 workers")


def scenario(model, module, weights_path: str | None) -> dict:
    """What the wrapped model (on each worker) and the reference (one device) run."""
    import numpy as np

    result = {"losses": step_losses(model, batches_of(module, STEPS, GLOBAL_BATCH))}
    if any("BatchNormalization" in type(l).__name__ for l in model.layers):
        # inference uses the moving statistics: this worker's copy equals one device's
        xi, _ = module.sample_batch(8)
        result["inference"] = np.asarray(model(xi, training=False)).tolist()
    if weights_path is None:
        return result
    x, y = module.sample_batch(3 * GLOBAL_BATCH)
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0,
                        validation_data=module.sample_batch(21))
    result["fit_losses"] = [float(v) for v in history.history["loss"]]
    result["val_losses"] = [float(v) for v in history.history["val_loss"]]
    xe, ye = module.sample_batch(21)
    result["eval_loss"] = float(model.evaluate(xe, ye, batch_size=8, verbose=0))
    result["predictions"] = np.asarray(model.predict(xe[:7], batch_size=4, verbose=0)).tolist()
    model.save_weights(weights_path)
    model.set_weights([np.zeros_like(w) for w in model.get_weights()])
    model.load_weights(weights_path)
    result["reloaded_eval_loss"] = float(model.evaluate(xe, ye, batch_size=8, verbose=0))
    return result


def train_cases(out_dir: str, cases: list, plans: list) -> None:
    """Wrap and train each case's model with its plan on this worker; write the results
    (losses, what ``scenario`` runs, mode, variable devices, weight and slot counts) to
    ``out_dir/worker{task}.json``. The first case also runs fit/evaluate/predict/files."""
    from tfplan import apply
    from tfplan.apply.placement import variable_devices

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    results = {}
    for (name, kind), plan in zip(cases, plans):
        module, model = base_model(name)
        wrapped = apply.wrap(model, plan)
        wrapped.compile(optimizer=optimizer_for(module, kind), loss=module.loss)
        full = (name, kind) == cases[0]
        result = scenario(wrapped, module,
                          os.path.join(out_dir, "model.weights.h5") if full else None)
        result.update(mode=type(wrapped).__name__, devices=variable_devices(wrapped),
                      weights=len(wrapped.trainable_variables),
                      slots=sum(1 for v in wrapped.optimizer.variables if len(v.shape)))
        results[f"{name} {kind}"] = result
    with open(os.path.join(out_dir, f"worker{task}.json"), "w", encoding="utf-8") as f:
        json.dump({"task": task, "results": results}, f)


def worker_main(out_dir: str) -> None:
    from tfplan import apply
    from tfplan.planner.plan import load_plan

    with open(os.path.join(out_dir, "cases.json"), encoding="utf-8") as f:
        cases = [tuple(case) for case in json.load(f)]
    plans = [load_plan(os.path.join(out_dir, f"plan{i}.json")) for i in range(len(cases))]
    apply.ensure_devices(plans[0])  # the strategy and 2 logical CPUs, before any TF op
    train_cases(out_dir, cases, plans)


def _reference(name: str, kind: str, weights_path: str | None) -> dict:
    module, copy = single_device_copy(name)
    copy.compile(optimizer=optimizer_for(module, kind), loss=module.loss)
    return scenario(copy, module, weights_path)


def launch_with_references(script: str, out_dir, cases: list) -> tuple[int, str, dict]:
    """``plan launch --workers 2 SCRIPT OUT_DIR``; while the workers run, the cases'
    single-device references are trained here. Returns (exit code, the end of the
    launch's output, {case: reference result})."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    launch = subprocess.Popen(
        [sys.executable, "-m", "tfplan.cli", "launch", "--workers", str(WORKERS),
         os.path.abspath(script), str(out_dir)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # the single-device references, while the workers start
        references = {
            f"{name} {kind}": _reference(name, kind,
                                         os.path.join(out_dir, "reference.weights.h5")
                                         if (name, kind) == cases[0] else None)
            for name, kind in cases}
        out, err = launch.communicate(timeout=420)
    finally:
        if launch.poll() is None:
            launch.terminate()
            launch.wait()
    return launch.returncode, out + err, references


def test_hybrid_plans_over_two_workers_train_like_one_device(tmp_path):
    run_cases_over_two_workers(tmp_path, DEFAULT_CASES)


@pytest.mark.slow
def test_the_other_models_hybrid_plans_over_two_workers_train_like_one_device(tmp_path):
    run_cases_over_two_workers(tmp_path, SLOW_CASES)


def run_cases_over_two_workers(tmp_path, cases: list) -> None:
    """Launch ``cases`` on two workers; each worker's losses (and what ``scenario`` runs)
    equal one device's, every variable on its planned device, ZeRO-1's slots one copy."""
    import numpy as np

    from tfplan.apply.mode import execution_mode
    from tfplan.planner.plan import save_plan

    for i, (name, kind) in enumerate(cases):  # the workers read them
        plan = worker_plan(base_model(name)[1], name, kind)
        assert execution_mode(plan).mode == ("multi_worker" if kind in ("dp2", "dp2+clip")
                                             else "multi_worker_hybrid")
        save_plan(plan, tmp_path / f"plan{i}.json")
    (tmp_path / "cases.json").write_text(json.dumps(cases), encoding="utf-8")
    returncode, logs, references = launch_with_references(__file__, tmp_path, cases)
    assert returncode == 0, logs[-6000:]
    docs = []
    for task in range(WORKERS):
        with open(tmp_path / f"worker{task}.json", encoding="utf-8") as f:
            doc = json.load(f)
        docs.append(doc)
        assert doc["task"] == task
        for case, reference in references.items():
            result = doc["results"][case]
            assert result["mode"] == MODE.get(case.split()[1], "MultiWorkerHybridModel"), case
            for key in reference:
                np.testing.assert_allclose(result[key], reference[key], rtol=1e-4, atol=1e-6,
                                           err_msg=f"{case}: {key}")
            name, kind = case.split()
            _check_devices(result["devices"], worker_plan(base_model(name)[1], name, kind),
                           task)
    assert (tmp_path / "model.weights.h5").is_file()  # written once, by the chief
    # ZeRO-1 over the job: the workers' optimizer slots (non-scalar variables) add up to
    # one copy of the state (the same plan without ZeRO holds one per local replica on
    # every worker), and each worker holds part of it
    zero_cases = [(zero, full, local_dp) for zero, full, local_dp in (
        ("tiny_mlp dp2+zero1", "tiny_mlp dp4", 2), ("tiny_mlp dp4+zero1", "tiny_mlp dp4", 2),
        ("tiny_transformer dp2xtp2+zero1", "tiny_transformer dp2xtp2", 1))
        if zero in references]
    assert all(full in references for _, full, _ in zero_cases)
    for zero, full, local_dp in zero_cases:
        held = [doc["results"][zero]["slots"] for doc in docs]
        one_copy = docs[0]["results"][full]["slots"] // local_dp
        assert sum(held) == one_copy and all(0 < h < one_copy for h in held), (zero, held)


def launch_train_script(tmp_path, *args: str, printing: tuple[int, ...] = (0, 1)) -> dict:
    """``plan launch --workers 2 examples/train.py ARGS --json``: each worker's result
    (``printing``: the workers expected to print one)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    env.pop("PLAN_FILE", None)
    launch = subprocess.run(
        [sys.executable, "-m", "tfplan.cli", "launch", "--workers", str(WORKERS),
         os.path.join(ROOT, "examples", "train.py"), "--model",
         os.path.join(HERE, "tiny_mlp.py"), "--json", *args],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert launch.returncode == 0, launch.stdout[-2000:] + launch.stderr[-4000:]
    results = {}
    for line in launch.stdout.splitlines():
        prefix, _, rest = line.partition("] ")
        if rest.startswith("{"):
            results[int(prefix.split()[-1])] = json.loads(rest)
    assert sorted(results) == list(printing), launch.stdout[-2000:]
    return results


def test_train_script_with_a_hybrid_plan_under_plan_launch(tmp_path):
    """``plan launch --workers 2 examples/train.py --plan P`` with a dp2 x pp2 plan: both
    workers train with the single-device losses (helpers.reference_losses)."""
    from tfplan.planner.plan import save_plan
    from tests.apply.helpers import STEPS as REFERENCE_STEPS, assert_losses_match, \
        reference_losses

    _, model = base_model("tiny_mlp")
    save_plan(worker_plan(model, "tiny_mlp", "dp2xpp2"), tmp_path / "plan.json")
    results = launch_train_script(tmp_path, "--plan", str(tmp_path / "plan.json"),
                                   "--steps", str(REFERENCE_STEPS))
    for task, result in results.items():
        assert result["plan"] == "tiny_mlp dp2xpp2 over 2 workers"
        assert_losses_match(result["losses"], reference_losses("tiny_mlp"))
        assert result["devices"]["dense_in/kernel"] == [dev(task, 0)]


def test_apply_auto_plans_the_multi_worker_job(tmp_path):
    """``plan launch --workers 2 examples/train.py --auto --cpus 2``: each worker plans
    for ``2xcpu:2`` (apply.auto with TF_CONFIG), both pick the same plan, which runs
    across the workers, and train with the single-device losses."""
    from tests.apply.helpers import GLOBAL_BATCH as REFERENCE_BATCH, STEPS as REFERENCE_STEPS, \
        assert_losses_match, reference_losses

    results = launch_train_script(tmp_path, "--auto", "--cpus", str(CPUS), "--global-batch",
                                   str(REFERENCE_BATCH), "--steps", str(REFERENCE_STEPS))
    plans = {result["plan"] for result in results.values()}
    assert len(plans) == 1, plans
    for task, result in results.items():
        assert_losses_match(result["losses"], reference_losses("tiny_mlp"))
        used = {d for where in result["devices"].values() for d in where}
        assert used and all(f"/job:worker/task:{task}/" in d for d in used), used


def _check_devices(devices: dict, plan, task: int) -> None:
    """Every variable and optimizer slot of this worker sits on one of the plan's devices
    of this worker's replica; a stage's layers on that stage's devices."""
    mine = {d for d in plan.devices if f"/task:{task}/" in d}
    for path, where in devices.items():
        assert where and set(where) <= mine, (path, where, sorted(mine))
    for stage in plan.stages:
        allowed = {d for d in stage.devices if f"/task:{task}/" in d}
        for layer in stage.layers:
            for path, where in devices.items():
                if path.startswith(layer + "/") or f"/{layer}_" in path:
                    assert set(where) <= allowed, (path, where, sorted(allowed))


def test_a_replica_across_workers_is_not_a_hybrid():
    import pytest

    from tfplan.apply.mode import execution_mode, plan_replica_tasks
    from tfplan.core.errors import PlannerError

    _, model = base_model("tiny_mlp")
    plan = worker_plan(model, "tiny_mlp", "dp2xpp2")
    # the Megatron layout: stage s on worker s, so each replica's pipeline spans both:
    # worker 0 drives every device (apply.remote, tests/apply/test_remote.py)
    stages = tuple(dataclasses.replace(st, devices=(dev(s, 0), dev(s, 1)))
                   for s, st in enumerate(plan.stages))
    across = dataclasses.replace(plan, stages=stages)
    assert execution_mode(across).remote and execution_mode(across).mode == "tensor_parallel"
    with pytest.raises(PlannerError, match="replica 0 on workers \\[0, 1\\]"):
        plan_replica_tasks(across)


if __name__ == "__main__":
    worker_main(sys.argv[1])
