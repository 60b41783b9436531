"""examples/train.py end to end: a fresh process, a plan.json, per-step losses.

The fresh process starts with one CPU device, so this also checks that
``apply.ensure_devices`` configures the plan's logical CPU devices before the
model is built.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tfplan.planner.plan import save_plan
from tests.apply.helpers import (GLOBAL_BATCH, HERE, STEPS, assert_losses_match, base_model,
                                 cpus, make_plan, reference_losses, single_device_copy,
                                 step_losses)

ROOT = os.path.dirname(os.path.dirname(HERE))


def test_train_script_with_a_pipeline_plan(tmp_path):
    _, model = base_model("tiny_mlp")
    plan_path = tmp_path / "plan.json"
    save_plan(make_plan(model, [cpus(1), cpus(3)], num_microbatches=2,
                        global_batch=GLOBAL_BATCH), plan_path)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train.py"), "--plan", str(plan_path),
         "--model", os.path.join(HERE, "tiny_mlp.py"), "--steps", str(STEPS), "--seed", "0",
         "--json"], capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["plan"] == "test dp=1 pp=2 m=2" and result["global_batch"] == GLOBAL_BATCH
    # same seed, same model file, same batches: the single-device losses of this process
    assert_losses_match(result["losses"], reference_losses("tiny_mlp"))
    devices = result["devices"]
    assert devices["dense_in/kernel"] == ["/device:CPU:1"]
    assert devices["head/kernel"] == ["/device:CPU:3"]
    assert devices["adam/head_kernel_momentum"] == ["/device:CPU:3"]


def _run_train(tmp_path, *args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train.py"), *args, "--json"],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_train_script_slices_dict_inputs_and_list_targets(tmp_path):
    """A two-input model (x a dict) with two outputs (y a list): every step trains on the
    same rows of every array, as one device does on hand-sliced batches."""
    module, model = single_device_copy("two_input")
    x, y = module.sample_batch(STEPS * GLOBAL_BATCH)
    batches = [({k: v[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH] for k, v in x.items()},
                [t[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH] for t in y]) for i in range(STEPS)]
    reference = step_losses(model, batches)
    common = ["--model", os.path.join(HERE, "two_input.py"), "--steps", str(STEPS),
              "--seed", "0", "--global-batch", str(GLOBAL_BATCH)]
    one = _run_train(tmp_path, *common)
    assert one["plan"] is None
    assert_losses_match(one["losses"], reference)
    plan_path = tmp_path / "plan.json"
    save_plan(make_plan(base_model("two_input")[1], [cpus(0, 1)], global_batch=GLOBAL_BATCH),
              plan_path)
    dp = _run_train(tmp_path, "--plan", str(plan_path), *common)
    assert dp["plan"] == "test dp=2 pp=1 m=1"
    assert_losses_match(dp["losses"], reference)
    assert dp["devices"]["trunk/kernel"] == ["/device:CPU:0", "/device:CPU:1"]
