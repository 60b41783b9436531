"""Measured profiles: real training steps captured by TensorFlow's profiler, read by XProf.

Timings on this 2-core machine are noisy, so only ratios are asserted. The
acceptance check is that the trace accounts for the step: per step, the layers'
forward + backward time plus the time of ops outside any layer (loss, optimizer
update, gradient sums) is within 15% of the measured step time. By
construction it can never exceed it on the CPU; what is missing is idle time
(Python and tf.function dispatch, scheduling, the sync), a fixed ~2 ms here,
so the examples run at batch sizes where a step is tens of milliseconds.
"""
from __future__ import annotations

import glob
import json
import os

import keras
import numpy as np
import pytest

from tfplan.core.errors import ModelLoadError, PlannerError
from tfplan.profiler import xprof_reader
from tfplan.profiler.loader import ModelSource, build, load_model_source
from tfplan.profiler.measure import (MeasuredProfile, _from_capture, attribute_ops, measure_model,
                              measure_source)
from tfplan.profiler.signature import profiled_layers
from tfplan.profiler.static import profile_model, profile_source

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
OP_FRACTION_MIN = 0.85  # the acceptance bound: within 15% of the step time


# --- the examples, end to end ----------------------------------------------------------------
@pytest.fixture(scope="module", params=[("mlp.py", 32768), ("cnn.py", 256)],
                ids=["mlp", "cnn"])
def measured(request, tmp_path_factory):
    filename, batch = request.param
    source = load_model_source(os.path.join(EXAMPLES, filename))
    logdir = str(tmp_path_factory.mktemp(filename.replace(".py", "")))
    result = measure_source(source, batch, logdir=logdir, steps=3, warmup_steps=1)
    return source, logdir, result


def test_layers_plus_ops_outside_layers_account_for_the_step(measured):
    _, _, m = measured
    total = m.layer_time_s + m.unattributed_time_s
    assert total <= m.step_time_s * (1 + 1e-9)
    assert abs(total - m.step_time_s) <= (1 - OP_FRACTION_MIN) * m.step_time_s, m.to_dict()
    assert m.op_fraction >= OP_FRACTION_MIN
    assert m.attributed_fraction > 0.5  # the layers themselves are most of the step
    assert m.idle_time_s == pytest.approx(m.step_time_s - total, rel=1e-6, abs=1e-12)


def test_every_profiled_layer_has_a_time_entry_named_as_in_the_static_profile(measured):
    source, _, m = measured
    static_names = [l.name for l in profile_source(source, 1).layers]
    assert [l.name for l in m.layers] == static_names
    assert [l.name for l in m.layers] == [l.name for l in profiled_layers(build(source))]
    for layer in m.layers:
        assert layer.time_fwd_s > 0, layer
        assert layer.scopes, layer


def test_layers_with_weights_have_backward_time(measured):
    source, _, m = measured
    model = build(source)
    for layer in profiled_layers(model):
        if layer.trainable_weights:
            assert m.layer(layer.name).time_bwd_s > 0, layer.name


def test_loss_and_optimizer_are_reported_outside_the_layers(measured):
    _, _, m = measured
    groups = dict(m.unattributed)
    assert "adam" in groups and "sparse_categorical_crossentropy" in groups
    assert sum(groups.values()) == pytest.approx(m.unattributed_time_s)


def test_capture_is_where_tensorboard_looks(measured):
    _, logdir, m = measured
    files = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
    assert files and m.trace_files
    assert all(os.path.isfile(f) for f in m.trace_files)
    assert set(m.trace_files) <= {os.path.abspath(f) for f in files}
    assert m.logdir == os.path.abspath(logdir)


def test_step_time_and_memory_are_reported_with_their_source(measured):
    _, _, m = measured
    assert m.step_time_s > 0 and m.step_time_unprofiled_s > 0
    assert m.device == "CPU:0" and "trace_viewer" in m.time_source
    assert m.peak_memory_bytes >= 0
    assert "RSS" in m.peak_memory_source or "get_memory_info" in m.peak_memory_source


def test_json_round_trip(measured):
    _, _, m = measured
    doc = json.loads(json.dumps(m.to_dict()))
    assert MeasuredProfile.from_dict(doc) == m
    assert doc["schema_version"] == 1 and doc["layer_time_s"] == pytest.approx(m.layer_time_s)


# --- attribution ------------------------------------------------------------------------------
def test_auto_named_layers_get_their_own_ops(tmp_path):
    """Keras names layers dense, dense_1, ...; TensorFlow uniquifies scopes as dense_1,
    dense_1_2, ...: parsing names would mix them up, recorded scopes do not."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((512,))
    big = keras.layers.Dense(2048)(inputs)          # "dense": 2048 x 512 multiply-adds
    small = keras.layers.Dense(1)(big)              # "dense_1": 2048
    model = keras.Model(inputs, small)
    names = [l.name for l in profiled_layers(model)]
    assert names[0].startswith("dense") and len(set(names)) == 2
    rng = np.random.default_rng(0)
    batch = (rng.standard_normal((256, 512), dtype=np.float32),
             rng.standard_normal((256, 1), dtype=np.float32))
    m = measure_model(model, batch, batch_size=256, loss="mse", optimizer="sgd", steps=2,
                      warmup_steps=1, logdir=str(tmp_path))
    first, second = m.layers
    assert set(first.scopes).isdisjoint(second.scopes)
    assert first.time_s > 5 * second.time_s  # 1024x the FLOPs


def test_nested_model_layers_are_measured_under_the_static_profile_names(tmp_path):
    inner = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, name="fc"),
                              keras.layers.Dense(16, name="proj")], name="block")
    inputs = keras.Input((16,))
    outputs = keras.layers.Dense(4, name="head")(inner(inputs))
    model = keras.Model(inputs, outputs)
    static_names = [l.name for l in profile_model(model, 1, optimizer="adam").layers]
    rng = np.random.default_rng(0)
    batch = (rng.standard_normal((64, 16), dtype=np.float32),
             rng.standard_normal((64, 4), dtype=np.float32))
    m = measure_model(model, batch, batch_size=64, loss="mse", steps=1, warmup_steps=1,
                      logdir=str(tmp_path))
    assert [l.name for l in m.layers] == static_names
    assert all(l.scopes and l.time_fwd_s > 0 for l in m.layers), m.layers


def test_attribute_ops_by_scope_forward_backward_and_the_rest():
    scopes = {"dense": ["functional_1/dense_1"], "dense_1": ["functional_1/dense_1_2"],
              "block": ["functional_1/block_1"], "inner": ["functional_1/block_1/inner_1"]}
    ops = {
        "functional_1/dense_1/MatMul": 1.0,
        "functional_1/dense_1_2/MatMul": 2.0,
        "gradient_tape/functional_1/dense_1/MatMul/MatMul": 4.0,
        "gradient_tape/functional_1/dense_1_2/BiasAdd/BiasAddGrad": 8.0,
        "functional_1/block_1/Relu": 16.0,
        "functional_1/block_1/inner_1/MatMul": 32.0,   # the longest scope wins
        "adam/Sub_3": 64.0, "adam/Mul": 128.0, "AddN_2": 256.0,
        "gradient_tape/mean_squared_error/Mul": 512.0,
    }
    layers, other = attribute_ops(ops, scopes)
    assert layers == {"dense": [1.0, 4.0], "dense_1": [2.0, 8.0], "block": [16.0, 0.0],
                      "inner": [32.0, 0.0]}
    assert other == {"adam": 192.0, "AddN": 256.0, "gradient_tape/mean_squared_error": 512.0}


# --- reading the trace ----------------------------------------------------------------------
def _event(name, ts, dur, tid=1, pid=1, **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid,
            "process": "/host:CPU", "args": args}


def test_concurrent_host_ops_split_the_wall_time():
    events = [
        _event("step 0", 0, 100, tid=9, step_num="0"),
        _event("MatMul", 10, 40, tid=1, long_name="a/MatMul:MatMul"),        # 10..50
        _event("Conv2D", 30, 40, tid=2, long_name="b/Conv2D:Conv2D"),        # 30..70
        _event("Outer", 80, 20, tid=1, long_name="c/Outer:PartitionedCall"),  # 80..100
        _event("Inner", 85, 10, tid=1, long_name="c/Inner:Relu"),            # nested 85..95
        _event("Later", 150, 10, tid=1, long_name="d/Later:Relu"),           # outside the step
        _event("ThreadpoolListener::Region", 0, 100, tid=3),                 # not an op
    ]
    steps = xprof_reader.step_windows(events, "step")
    assert [(s.step_num, s.duration_s) for s in steps] == [(0, pytest.approx(100e-6))]
    times = xprof_reader.host_op_wall_times(events, steps)
    us = {k: round(v * 1e6, 6) for k, v in times.op_time_s.items()}
    # 10..30 a alone (20), 30..50 a and b (10 each), 50..70 b alone (20); c self 10, inner 10
    assert us == {"a/MatMul": 30.0, "b/Conv2D": 30.0, "c/Outer": 10.0, "c/Inner": 10.0}
    assert times.busy_s == pytest.approx(80e-6)
    assert sum(times.op_time_s.values()) == pytest.approx(times.busy_s)


def test_gpu_capture_uses_device_op_times(monkeypatch):
    """The GPU branch (no GPU here): op times come from framework_op_stats Device rows."""
    trace = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "X", "name": "measured_train_step 0", "ts": 0, "dur": 1000, "pid": 1, "tid": 1,
         "args": {"step_num": "0"}},
        {"ph": "X", "name": "measured_train_step 1", "ts": 2000, "dur": 1000, "pid": 1,
         "tid": 1, "args": {"step_num": "1"}}]}
    cols = [{"id": c} for c in ("host_or_device", "type", "operation", "total_self_time")]

    def row(*values):
        return {"c": [{"v": v} for v in values]}

    stats = [{"cols": cols, "rows": [row("Device", "IDLE", "IDLE", 5000.0)]},
             {"cols": cols, "rows": [
                 row("Device", "MatMul", "m_1/d_1/MatMul", 600.0),
                 row("Device", "MatMul", "gradient_tape/m_1/d_1/MatMul/MatMul", 800.0),
                 row("Device", "Mul", "adam/Mul", 200.0),
                 row("Host", "MatMul", "m_1/d_1/MatMul", 999.0)]}]
    monkeypatch.setattr(xprof_reader, "tool_json",
                        lambda paths, tool: trace if tool == "trace_viewer" else stats)

    class Dense:  # stands in for a Keras layer: its class name is its type
        pass

    m = _from_capture([("d", Dense())], {"d": ["m_1/d_1"]}, ["x.xplane.pb"], batch_size=4,
                      steps=2, warmup_steps=1, device="GPU:0 (test)",
                      step_time_unprofiled_s=1e-3, peak_memory_bytes=10,
                      peak_memory_source="test", logdir="/tmp", name="m")
    assert m.step_time_s == pytest.approx(1e-3)
    (layer,) = m.layers
    assert (layer.name, layer.type, layer.scopes) == ("d", "Dense", ("m_1/d_1",))
    assert (layer.time_fwd_s, layer.time_bwd_s) == (pytest.approx(300e-6), pytest.approx(400e-6))
    assert m.unattributed == (("adam", pytest.approx(100e-6)),)
    assert m.idle_time_s == pytest.approx(200e-6)
    assert "framework_op_stats" in m.time_source


# --- errors -----------------------------------------------------------------------------------
def test_measuring_needs_sample_batch(tmp_path):
    source = load_model_source(os.path.join(EXAMPLES, "mlp.py"))
    bare = ModelSource(name=source.name, build_model=source.build_model, loss=source.loss,
                       optimizer=source.optimizer, sample_batch=None, origin="model.py")
    with pytest.raises(ModelLoadError, match=r"sample_batch\(batch_size\)"):
        measure_source(bare, 8, logdir=str(tmp_path))


@pytest.mark.parametrize("kwargs, text", [
    ({"steps": 0}, "steps must be an integer >= 1; received 0"),
    ({"batch_size": True}, "batch_size must be an integer >= 1"),
    ({"loss": None}, "needs a loss"),
    ({"optimizer": 3}, "expected a Keras optimizer"),
])
def test_bad_arguments_say_what_was_received(tmp_path, kwargs, text):
    source = load_model_source(os.path.join(EXAMPLES, "mlp.py"))
    args = dict(batch_size=8, loss="mse", optimizer="adam", logdir=str(tmp_path))
    args.update(kwargs)
    with pytest.raises(PlannerError, match=text.replace("(", r"\(").replace(")", r"\)")):
        measure_model(build(source), source.sample_batch, **args)


def test_schema_version_is_checked():
    with pytest.raises(PlannerError, match="schema_version"):
        MeasuredProfile.from_dict({"schema_version": 99})
