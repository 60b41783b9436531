"""apply.auto: profile, search for this process's devices, wrap; PLAN_FILE; the script.

What is asserted: auto describes this process's logical CPU devices as ``cpu:N``;
on 4 logical CPUs it returns a wrapped model whose plan apply runs in full and
whose losses equal single-device training (1e-4 relative), and says on stderr
which plan it chose and why; a search choice apply cannot run falls back to the
best candidate it can (and says so); PLAN_FILE is loaded instead of searching,
and a PLAN_FILE for another model raises PlanMismatchError before training; a
global batch the plan cannot split is refused before any training; TF_CONFIG
with several workers is refused unless PLAN_FILE is given; examples/train.py
--auto trains in a fresh process (with and without PLAN_FILE).
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfplan import apply
from tfplan.core.errors import PlanMismatchError, PlannerError
from tfplan.planner.plan import save_plan
from tfplan.planner.search import SearchResult
from tests.apply.helpers import (GLOBAL_BATCH, HERE, STEPS, assert_losses_match, base_model,
                                 batches_of, cpu_cluster, cpus, fresh_optimizer, load_model_file,
                                 make_plan, reference_losses, step_losses)

auto_module = importlib.import_module("tfplan.apply.auto")  # `apply.auto` is the function
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture(autouse=True)
def no_plan_file(monkeypatch):
    monkeypatch.delenv("PLAN_FILE", raising=False)
    monkeypatch.delenv("TF_CONFIG", raising=False)


def train(wrapped, module):
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    return step_losses(wrapped, batches_of(module, STEPS, GLOBAL_BATCH))


def test_local_cluster_is_the_logical_cpus_of_this_process():
    n = len(tf.config.list_logical_devices("CPU"))
    cluster = auto_module.local_cluster()
    assert cluster.name == f"cpu:{n}" and cluster.num_devices == n
    assert cluster.device_names() == tuple(f"/device:CPU:{i}" for i in range(n))


def test_auto_on_4_cpus_trains_like_one_device(capsys):
    module, model = base_model("tiny_mlp")
    # cpu:4 with separate cores (tests/apply/helpers): data parallelism pays off here
    wrapped = apply.auto(model, GLOBAL_BATCH, cluster=cpu_cluster(4))
    plan = wrapped.plan
    assert auto_module.runnable(plan)
    assert set(plan.devices) <= set(cpus(0, 1, 2, 3)) and plan.strategy.dp > 1
    assert plan.global_batch == GLOBAL_BATCH and plan.model_name == model.name
    err = capsys.readouterr().err
    assert f"apply.auto: plan {plan.name!r} for cpu:4 (4 device(s)), global batch 16" in err
    assert "predicted" in err and len(err.strip().splitlines()) == 1
    assert_losses_match(train(wrapped, module), reference_losses("tiny_mlp"))


def test_auto_with_the_process_devices_and_the_compiled_optimizer(capsys):
    module, model = base_model("tiny_mlp")
    compiled = keras.models.clone_model(model)
    compiled.set_weights(model.get_weights())
    compiled.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse")
    wrapped = apply.auto(compiled, GLOBAL_BATCH)
    n = len(tf.config.list_logical_devices("CPU"))
    assert wrapped.plan.cluster.name == f"cpu:{n}" and wrapped.plan.optimizer == "sgd"
    assert wrapped.compiled  # compiled like the user's model (apply.wrap)
    assert f"for cpu:{n} ({n} device(s))" in capsys.readouterr().err
    x, y = batches_of(module, 1, GLOBAL_BATCH)[0]
    assert np.isfinite(wrapped.train_on_batch(x, y))


def hybrid_and_data_parallel(model):
    """A plan apply.wrap cannot run yet (tensor parallel with the weights offloaded to the
    host) and one it can."""
    import dataclasses

    hybrid = make_plan(model, [cpus(0, 1)], name="tensor parallel offloaded")
    hybrid = dataclasses.replace(hybrid, strategy=dataclasses.replace(
        hybrid.strategy, dp=1, tp=2, offload="optimizer+weights"))
    dp = make_plan(model, [cpus(0, 1)], name="data parallel dp=2")
    return hybrid, dp


def test_a_choice_apply_cannot_run_falls_back_to_the_best_it_can(monkeypatch, capsys):
    module, model = base_model("tiny_mlp")
    hybrid, dp = hybrid_and_data_parallel(model)
    monkeypatch.setattr("tfplan.planner.search.search", lambda *a, **k: SearchResult(
        chosen=hybrid.with_reason("fastest"), candidates=(hybrid, dp)))
    wrapped = apply.auto(model, GLOBAL_BATCH, cluster=cpu_cluster(4))
    assert wrapped.plan.name == "data parallel dp=2"
    assert "search chose tensor parallel offloaded" in wrapped.plan.reason
    err = capsys.readouterr().err
    assert "the search chose 'tensor parallel offloaded', which apply.wrap cannot run yet" in err
    assert "offload='optimizer+weights' with tp=2" in err
    assert "'data parallel dp=2' is the fastest" in err
    assert_losses_match(train(wrapped, module), reference_losses("tiny_mlp"))

    monkeypatch.setattr("tfplan.planner.search.search", lambda *a, **k: SearchResult(
        chosen=hybrid, candidates=(hybrid,)))
    with pytest.raises(PlannerError, match="cannot run yet.*PLAN_FILE"):
        apply.auto(model, GLOBAL_BATCH, cluster=cpu_cluster(4))


def test_plan_file_is_loaded_instead_of_searching(tmp_path, monkeypatch, capsys):
    module, model = base_model("tiny_mlp")
    path = tmp_path / "plan.json"
    save_plan(make_plan(model, [cpus(1), cpus(3)], num_microbatches=2,
                        global_batch=GLOBAL_BATCH), path)
    monkeypatch.setenv("PLAN_FILE", str(path))

    def no_search(*args, **kwargs):
        raise AssertionError("apply.auto searched although PLAN_FILE is set")

    monkeypatch.setattr("tfplan.planner.search.search", no_search)
    wrapped = apply.auto(model, GLOBAL_BATCH)
    assert wrapped.plan.name == "test dp=1 pp=2 m=2"
    assert f"from PLAN_FILE={path}" in capsys.readouterr().err
    assert apply.variable_devices(wrapped)["head/kernel"] == ["/device:CPU:3"]
    assert_losses_match(train(wrapped, module), reference_losses("tiny_mlp"))


def test_plan_file_for_another_model_fails_before_training(tmp_path, monkeypatch):
    module, model = base_model("tiny_mlp")
    other = keras.Sequential([keras.Input(shape=(12,)), keras.layers.Dense(5, name="only")],
                             name="other")
    path = tmp_path / "plan.json"
    save_plan(make_plan(other, [cpus(0)]), path)
    monkeypatch.setenv("PLAN_FILE", str(path))
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(PlanMismatchError, match="made for model 'other'"):
        apply.auto(model, GLOBAL_BATCH)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_global_batch_the_plan_cannot_split_fails_before_training(tmp_path, monkeypatch):
    module, model = base_model("tiny_mlp")
    path = tmp_path / "plan.json"
    save_plan(make_plan(model, [cpus(0, 1)], num_microbatches=2, global_batch=16), path)
    monkeypatch.setenv("PLAN_FILE", str(path))
    with pytest.raises(PlanMismatchError, match=r"Global batch 10 does not split .* 4 equal "
                                                r"parts\. Use a global batch of 8 or 12"):
        apply.auto(model, 10)
    with pytest.raises(PlannerError, match="global_batch=0"):
        apply.auto(model, 0)
    monkeypatch.delenv("PLAN_FILE")
    # a searched plan (the SPMD engine): a batch that does not split into equal parts
    # trains like one device (each replica's rows cut nearly equal, weighed by their count)
    wrapped = apply.auto(model, GLOBAL_BATCH, cluster=cpu_cluster(4))
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    reference = keras.models.clone_model(model)
    reference.set_weights(wrapped.get_weights())
    reference.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    x, y = module.sample_batch(wrapped.plan.strategy.dp * 2 + 1)
    assert_losses_match([wrapped.train_on_batch(x, y) for _ in range(2)],
                        [reference.train_on_batch(x, y) for _ in range(2)])


def test_several_workers_in_tf_config_need_auto_devices_first_or_a_plan_file(tmp_path,
                                                                             monkeypatch):
    """Planning a multi-worker job needs its strategy, made by apply.auto_devices() before
    TensorFlow starts (tests.apply.test_workers.py runs that for real); here
    the runtime has started without it, so apply.auto says what to call."""
    _, model = base_model("tiny_mlp")
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
        "task": {"type": "worker", "index": 0}}))
    with pytest.raises(PlannerError, match="TF_CONFIG names 2 workers.*auto_devices"):
        apply.auto(model, GLOBAL_BATCH)
    path = tmp_path / "plan.json"
    save_plan(make_plan(model, [cpus(0)]), path)
    monkeypatch.setenv("PLAN_FILE", str(path))
    assert apply.auto(model, GLOBAL_BATCH).plan.name == "test dp=1 pp=1 m=1"


# --- examples/train.py --auto in a fresh process -------------------------------------------

def run_script(*args, env_extra=None, cwd):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    env.pop("PLAN_FILE", None)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train.py"), "--auto",
         "--model", os.path.join(HERE, "tiny_mlp.py"), "--seed", "0", "--json", *args],
        capture_output=True, text=True, env=env, cwd=str(cwd), timeout=240)


def test_train_script_auto_mode_plans_and_trains(tmp_path):
    proc = run_script("--cpus", "4", "--steps", str(STEPS), "--global-batch",
                      str(GLOBAL_BATCH), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["plan"] and result["global_batch"] == GLOBAL_BATCH
    assert "apply.auto: plan" in proc.stderr and "for cpu:4 (4 device(s))" in proc.stderr
    assert_losses_match(result["losses"], reference_losses("tiny_mlp"))


def test_train_script_auto_mode_with_a_plan_file(tmp_path):
    _, model = base_model("tiny_mlp")
    path = tmp_path / "plan.json"
    save_plan(make_plan(model, [cpus(0), cpus(2)], num_microbatches=2,
                        global_batch=GLOBAL_BATCH), path)
    proc = run_script("--steps", str(STEPS), env_extra={"PLAN_FILE": str(path)},
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["plan"] == "test dp=1 pp=2 m=2" and result["global_batch"] == GLOBAL_BATCH
    assert result["devices"]["head/kernel"] == ["/device:CPU:2"]
    assert_losses_match(result["losses"], reference_losses("tiny_mlp"))


@pytest.mark.parametrize("name,capability,memory,kind,memory_bytes", [
    ("NVIDIA A100-SXM4-80GB", (8, 0), 79 << 30, "A100-80GB", 80 << 30),
    ("NVIDIA A100-SXM4-40GB", (8, 0), 39 << 30, "A100-40GB", 40 << 30),
    ("NVIDIA H200", (9, 0), 139 << 30, "NVIDIA-H200", 139 << 30),
])
def test_gpu_cluster_takes_the_matching_preset(monkeypatch, capsys, name, capability, memory,
                                               kind, memory_bytes):
    """GPUs found by TensorFlow (faked here: the tests run on CPU) -> a preset's figures."""
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda t=None: ["gpu0", "gpu1"])
    monkeypatch.setattr(tf.config.experimental, "get_device_details",
                        lambda d: {"device_name": name, "compute_capability": capability})
    monkeypatch.setattr(auto_module, "_gpu_memory_bytes", lambda: memory)
    cluster = auto_module.gpu_cluster(2)
    assert cluster.num_devices == 2 and cluster.device.device_type == "GPU"
    assert cluster.device.kind == kind and cluster.device.memory_bytes == memory_bytes
    assert cluster.device_names() == ("/device:GPU:0", "/device:GPU:1")
    unknown = "no cluster preset names GPU" in capsys.readouterr().err
    assert unknown == (kind == "NVIDIA-H200")


def test_auto_plans_a_model_with_a_dynamic_sequence_for_the_shapes_given(capsys):
    """A model whose inputs leave the sequence length open is planned for ``input_shapes``
    (as ``plan analyze --input-shape``); the wrapped model trains on that length and
    refuses another."""
    ids = keras.Input((None,), dtype="int32", name="ids")
    x = keras.layers.Embedding(16, 8, name="embed")(ids)
    model = keras.Model(ids, keras.layers.Dense(4, name="head")(x))
    with pytest.raises(PlannerError, match="ids"):
        apply.auto(model, 8, cluster=cpu_cluster(2))
    wrapped = apply.auto(model, 8, cluster=cpu_cluster(2), input_shapes={"*": (6,)})
    assert wrapped.plan.model_input_shapes == (("ids", (6,)),)
    wrapped.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    wrapped.train_on_batch(rng.integers(0, 16, (8, 6)), rng.normal(size=(8, 6, 4)))
    with pytest.raises(PlanMismatchError, match="ids"):
        wrapped.train_on_batch(rng.integers(0, 16, (8, 5)), rng.normal(size=(8, 5, 4)))


def test_auto_of_a_builder_plans_once_and_each_device_builds_its_copy(capsys):
    from tfplan.apply.spmd import SpmdModel

    module = load_model_file("tiny_vit")  # custom layers without get_config
    keras.utils.set_random_seed(0)
    wrapped = apply.auto(module.build_model, GLOBAL_BATCH, cluster=cpu_cluster(4))
    assert isinstance(wrapped, SpmdModel) and wrapped.plan.strategy.dp > 1
    reference = module.build_model()
    reference.set_weights(wrapped.get_weights())
    for target in (wrapped, reference):
        target.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    x, y = module.sample_batch(GLOBAL_BATCH)
    assert wrapped.train_on_batch(x, y) == pytest.approx(reference.train_on_batch(x, y),
                                                         rel=1e-4)
