"""Multi-worker data parallel (``apply.multi_worker``): two local worker processes.

``plan launch --workers 2`` starts this file as a script on two workers (TF_CONFIG
on 127.0.0.1, PLAN_FILE); each wraps the tiny MLP with a plan for ``2xcpu:1``
(dp=2, one CPU per worker, MultiWorkerMirroredStrategy) and runs ``scenario``:
10 ``train_on_batch`` steps, ``fit`` on arrays (with validation data) and on a ``tf.data.Dataset``,
``evaluate`` and ``predict`` on batches that do not split evenly, and
``save_weights``/``load_weights``. The test process runs the same scenario on one
device: every number must agree within 1e-4 (relative).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

if __name__ == "__main__":  # a worker: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))

from tests.apply.helpers import (HERE, base_model, batches_of, fresh_optimizer,  # noqa: E402
                                 make_plan, step_losses)

ROOT = os.path.dirname(os.path.dirname(HERE))
WORKERS = 2
STEPS = 10
GLOBAL_BATCH = 16


def worker_plan(model):
    """dp=2 over ``/job:worker/task:{0,1}/device:CPU:0`` (a ``2xcpu:1`` cluster)."""
    devices = [f"/job:worker/task:{w}/device:CPU:0" for w in range(WORKERS)]
    plan = make_plan(model, [devices], global_batch=GLOBAL_BATCH, name="test 2 workers")
    one = plan.cluster
    cluster = dataclasses.replace(one, name=f"{WORKERS}xcpu:1", num_nodes=WORKERS,
                                  devices_per_node=1, inter_node_link=one.intra_node_link)
    return dataclasses.replace(plan, cluster=cluster)


def scenario(model, module, weights_path: str) -> dict:
    """What both the wrapped model (on each worker) and the reference (one device) run."""
    import numpy as np
    import tensorflow as tf

    result = {"losses": step_losses(model, batches_of(module, STEPS, GLOBAL_BATCH))}
    x, y = module.sample_batch(3 * GLOBAL_BATCH)
    xe, ye = module.sample_batch(21)  # batches of 8, 8, 5 (or 16, 5): uneven over 2 replicas
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0,
                        validation_data=(xe, ye))
    result["fit_losses"] = [float(v) for v in history.history["loss"]]
    result["val_losses"] = [float(v) for v in history.history["val_loss"]]
    dataset = tf.data.Dataset.from_tensor_slices((x[::-1].copy(), y[::-1].copy())).batch(
        GLOBAL_BATCH)
    history = model.fit(dataset, epochs=1, verbose=0)
    result["fit_losses"] += [float(v) for v in history.history["loss"]]
    result["eval_loss"] = float(model.evaluate(xe, ye, batch_size=8, verbose=0))
    result["predictions"] = np.asarray(model.predict(xe[:7], batch_size=4, verbose=0)).tolist()
    model.save_weights(weights_path)
    model.set_weights([np.zeros_like(w) for w in model.get_weights()])
    result["zeroed_eval_loss"] = float(model.evaluate(xe, ye, batch_size=8, verbose=0))
    model.load_weights(weights_path)
    result["reloaded_eval_loss"] = float(model.evaluate(xe, ye, batch_size=8, verbose=0))
    return result


def worker_main(out_dir: str) -> None:
    from tfplan import apply
    from tfplan.planner.plan import load_plan

    plan = load_plan(os.environ["PLAN_FILE"])
    apply.ensure_devices(plan)  # makes the MultiWorkerMirroredStrategy: before any TF op
    module, model = base_model("tiny_mlp")
    wrapped = apply.wrap(model, plan)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    result = scenario(wrapped, module, os.path.join(out_dir, "model.weights.h5"))
    result.update(task=task, mode=type(wrapped).__name__,
                  devices=apply.variable_devices(wrapped))
    with open(os.path.join(out_dir, f"worker{task}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)


def test_two_workers_train_like_one_device(tmp_path):
    import keras
    import numpy as np

    from tfplan.planner.plan import save_plan

    module, model = base_model("tiny_mlp")
    plan_path = tmp_path / "plan.json"
    save_plan(worker_plan(model), plan_path)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    launch = subprocess.Popen(
        [sys.executable, "-m", "tfplan.cli", "launch", "--workers", str(WORKERS), "--plan",
         str(plan_path), os.path.abspath(__file__), str(tmp_path)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # the single-device reference, while the workers start
        reference_model = keras.models.clone_model(model)
        reference_model.set_weights(model.get_weights())
        reference_model.compile(optimizer=fresh_optimizer(module), loss=module.loss)
        reference = scenario(reference_model, module, str(tmp_path / "reference.weights.h5"))
        out, err = launch.communicate(timeout=240)
    finally:
        if launch.poll() is None:
            launch.terminate()  # plan launch stops its workers on SIGTERM
            launch.wait()
    assert launch.returncode == 0, out[-2000:] + err[-4000:]
    assert len(reference["losses"]) == STEPS and len(reference["fit_losses"]) == 3

    for task in range(WORKERS):
        with open(tmp_path / f"worker{task}.json", encoding="utf-8") as f:
            result = json.load(f)
        assert result["task"] == task and result["mode"] == "MultiWorkerModel"
        for key in ("losses", "fit_losses", "val_losses", "eval_loss", "reloaded_eval_loss"):
            np.testing.assert_allclose(result[key], reference[key], rtol=1e-4, err_msg=key)
        np.testing.assert_allclose(result["predictions"], reference["predictions"],
                                   rtol=1e-4, atol=1e-5)
        assert result["zeroed_eval_loss"] != result["eval_loss"]  # the load did restore
        # one mirrored copy per worker, on that worker's CPU; optimizer slots alongside
        here = f"/job:worker/task:{task}/device:CPU:0"  # as the plan names it
        assert result["devices"]["dense_in/kernel"] == [here]
        assert result["devices"]["adam/head_kernel_momentum"] == [here]
    assert (tmp_path / "model.weights.h5").is_file()  # written once, by the chief


def test_train_script_under_plan_launch(tmp_path):
    """``plan launch --workers 2 examples/train.py --plan P``: both workers print the
    single-device losses (helpers.reference_losses: same seed, model file, batches)."""
    from tfplan.planner.plan import save_plan
    from tests.apply.helpers import STEPS as REFERENCE_STEPS, assert_losses_match, \
        reference_losses

    _, model = base_model("tiny_mlp")
    plan_path = tmp_path / "plan.json"
    save_plan(worker_plan(model), plan_path)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    launch = subprocess.Popen(
        [sys.executable, "-m", "tfplan.cli", "launch", "--workers", str(WORKERS),
         os.path.join(ROOT, "examples", "train.py"), "--plan", str(plan_path), "--model",
         os.path.join(HERE, "tiny_mlp.py"), "--steps", str(REFERENCE_STEPS), "--json"],
        cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        reference = reference_losses("tiny_mlp")
        out, err = launch.communicate(timeout=240)
    finally:
        if launch.poll() is None:
            launch.terminate()
            launch.wait()
    assert launch.returncode == 0, out[-2000:] + err[-4000:]
    results = {}
    for line in out.splitlines():
        prefix, _, rest = line.partition("] ")
        if rest.startswith("{"):
            results[prefix] = json.loads(rest)
    assert sorted(results) == ["[worker 0", "[worker 1"]
    for task, result in enumerate(results[f"[worker {i}"] for i in range(WORKERS)):
        assert result["plan"] == "test 2 workers" and result["global_batch"] == GLOBAL_BATCH
        assert_losses_match(result["losses"], reference)
        assert result["devices"]["head/kernel"] == [f"/job:worker/task:{task}/device:CPU:0"]


def test_a_plan_over_workers_is_multi_worker_mode_and_needs_tf_config(monkeypatch):
    import pytest

    from tfplan import apply
    from tfplan.apply.mode import execution_mode
    from tfplan.core.errors import PlanMismatchError, PlannerError

    _, model = base_model("tiny_mlp")
    plan = worker_plan(model)
    assert execution_mode(plan).mode == "multi_worker"
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(PlannerError, match="plan launch --workers"):
        apply.ensure_devices(plan)
    three = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]},
             "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(three))
    with pytest.raises(PlanMismatchError, match="TF_CONFIG describes 3"):
        apply.ensure_devices(plan)
    pipeline = make_plan(model, [[d] for d in plan.devices], name="pipeline over workers")
    pipeline = dataclasses.replace(pipeline, cluster=plan.cluster)
    assert execution_mode(pipeline).mode == "pipeline"  # worker 0 drives both (apply.remote)


if __name__ == "__main__":
    worker_main(sys.argv[1])
