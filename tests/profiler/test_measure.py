"""Measured profiles: real training steps captured by TensorFlow's profiler, read by XProf.

Timings on this 2-core machine are noisy, so only ratios are asserted. The
acceptance check is that the trace accounts for the step: per step, the layers'
forward + backward time plus the time of ops outside any layer (loss, optimizer
update, gradient sums) is within 15% of the measured step time. By
construction it can never exceed it on the CPU; what is missing is idle time
(Python and tf.function dispatch, scheduling, the sync), a fixed ~2 ms here,
so the examples run at batch sizes where a step is tens of milliseconds (the CNN at
batch 256, a 12 ms step, read 84% under CI load; at 512 the fixed idle is half the share).
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
from tfplan.profiler.fused_kernels import GraphOp, find_fused_kernels
from tfplan.profiler.measure import (MeasuredProfile, _from_capture, attribute_kernels,
                                     attribute_ops, measure_model, measure_source)
from tfplan.profiler.measured_profile import LayerTime
from tfplan.profiler.signature import profiled_layers
from tfplan.profiler.static import profile_model, profile_source

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
OP_FRACTION_MIN = 0.85  # the acceptance bound: within 15% of the step time


# --- the examples, end to end ----------------------------------------------------------------
@pytest.fixture(scope="module", params=[("mlp.py", 32768), ("cnn.py", 512)],
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
    # forward: 1024x the FLOPs. (Backward, the small layer also computes its input
    # gradient, a 256x2048 tensor written to memory, while the big one reads a model
    # input and computes none: its total time under load came within 5x.)
    assert first.time_fwd_s > 5 * second.time_fwd_s
    assert first.time_s > second.time_s


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


# --- fused kernels ----------------------------------------------------------------------------
def _residual_graph():
    """m/a: Conv2D -> BiasAdd; m/b: AddV2 of the pool and the bias add (FLOPs made up)."""
    return [
        GraphOp("x", "Placeholder"),
        GraphOp("m/pool/MaxPool", "MaxPool", ("x",), 40),
        GraphOp("m/a/conv/ReadVariableOp", "ReadVariableOp"),
        GraphOp("m/a/conv", "Conv2D", ("m/pool/MaxPool", "m/a/conv/ReadVariableOp"), 900),
        GraphOp("m/a/Squeeze", "Squeeze", ("m/a/conv/ReadVariableOp",)),
        GraphOp("m/a/BiasAdd", "BiasAdd", ("m/a/conv", "m/a/Squeeze"), 50),
        GraphOp("m/b/Add", "AddV2", ("m/pool/MaxPool", "m/a/BiasAdd"), 50),
        GraphOp("m/c/Relu", "Relu", ("m/b/Add",), 50),
        GraphOp("gradient_tape/m/c/ReluGrad", "ReluGrad", ("m/c/Relu",), 50),
        GraphOp("gradient_tape/m/a/conv/Shape", "Shape", ("m/a/conv",)),  # shape only
        GraphOp("adam/Mul", "Mul", (), 10),
    ]


RESIDUAL_SCOPES = {"pool": ["m/pool"], "a": ["m/a"], "b": ["m/b"], "c": ["m/c"]}


def test_a_fused_kernel_splits_its_time_among_the_layers_of_its_ops_by_flops():
    times = {"m/pool/MaxPool": 1.0, "m/a/conv/ReadVariableOp": 0.5, "m/b/Add": 10.0,
             "m/c/Relu": 2.0, "gradient_tape/m/c/ReluGrad": 3.0, "adam/Mul": 4.0}
    types = {"m/pool/MaxPool": "_MklNativeMaxPool", "m/a/conv/ReadVariableOp": "ReadVariableOp",
             "m/b/Add": "_FusedConv2D", "m/c/Relu": "Relu",
             "gradient_tape/m/c/ReluGrad": "ReluGrad", "adam/Mul": "Mul"}
    (kernel,) = find_fused_kernels(_residual_graph(), types)
    assert kernel.op == "m/b/Add" and kernel.kernel_type == "_FusedConv2D"
    assert kernel.covered == ("m/b/Add", "m/a/BiasAdd", "m/a/conv")  # not the Squeeze
    assert kernel.shares == pytest.approx((0.05, 0.05, 0.9))
    layers, other, shared, notes = attribute_kernels(times, types, _residual_graph(),
                                                     RESIDUAL_SCOPES)
    assert layers == {"pool": [1.0, 0.0], "a": [pytest.approx(10.0 * 0.95 + 0.5), 0.0],
                      "b": [pytest.approx(0.5), 0.0], "c": [2.0, 3.0]}
    assert other == {"adam": 4.0}
    assert shared == {"a": ("b",), "b": ("a",)}
    (note,) = notes
    assert "m/b/Add (_FusedConv2D)" in note and "layers a, b" in note
    assert "a 95.0%, b 5.0%" in note and "FLOPs" in note and "10000.000 ms" in note


def test_unfused_graph_is_attributed_as_before():
    """Renamed kernels (_MklMatMul) and ops that ran as their own type fuse nothing."""
    graph = _residual_graph()
    times = {op.name: float(i + 1) for i, op in enumerate(graph) if op.type != "Placeholder"}
    types = {op.name: ("_Mkl" + op.type if op.type == "Conv2D" else op.type) for op in graph
             if op.name in times}
    assert find_fused_kernels(graph, types) == []
    layers, other, shared, notes = attribute_kernels(times, types, graph, RESIDUAL_SCOPES)
    assert (layers, other) == attribute_ops(times, RESIDUAL_SCOPES)
    assert shared == {} and notes == []


def test_an_intermediate_read_elsewhere_is_not_part_of_the_kernel():
    """The BiasAdd's output also feeds a gradient op: it cannot have vanished into the Add."""
    graph = _residual_graph() + [GraphOp("gradient_tape/m/a/Mul", "Mul", ("m/a/BiasAdd",), 50)]
    types = {"m/b/Add": "_FusedConv2D", "m/pool/MaxPool": "MaxPool"}
    assert find_fused_kernels(graph, types) == []
    types["m/c/Relu"] = "_MklFusedAddRelu"  # Relu + Add in one kernel; the conv is elsewhere
    types.pop("m/b/Add")
    (kernel,) = find_fused_kernels(graph, types)
    assert kernel.covered == ("m/c/Relu", "m/b/Add") and kernel.shares == (0.5, 0.5)


def test_fused_kernel_time_is_conserved_and_split_equally_without_flops():
    graph = [GraphOp("m/a/MatMul", "MatMul", ("x",)), GraphOp("m/a/BiasAdd", "BiasAdd",
                                                                ("m/a/MatMul",)),
             GraphOp("m/b/Relu", "Relu", ("m/a/BiasAdd",)),
             GraphOp("loss/Mul", "Mul", ("m/b/Relu",), 7)]
    times = {"m/b/Relu": 0.3, "loss/Mul": 0.7, "gradient_tape/m/a/MatMul": 0.11}
    types = {"m/b/Relu": "_FusedMatMul", "loss/Mul": "Mul", "gradient_tape/m/a/MatMul": "MatMul"}
    scopes = {"a": ["m/a"], "b": ["m/b"]}
    layers, other, shared, notes = attribute_kernels(times, types, graph, scopes)
    total = sum(f + b for f, b in layers.values()) + sum(other.values())
    assert total == pytest.approx(sum(times.values()), rel=1e-12)
    assert layers == {"a": [pytest.approx(0.2), pytest.approx(0.11)],
                      "b": [pytest.approx(0.1), 0.0]}
    assert shared == {"a": ("b",), "b": ("a",)} and len(notes) == 1


def test_layer_times_keep_what_they_share_and_old_files_still_load():
    t = LayerTime("add_1", "Add", 1e-6, 0.0, ("cnn_1/add_1_1",), ("conv_3", "relu_1"))
    assert LayerTime.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    old = {k: v for k, v in t.to_dict().items() if k != "fused_with"}
    assert LayerTime.from_dict(old).fused_with == ()


def test_host_op_types_are_the_kernels_that_ran():
    events = [_event("_MklNativeFusedMatMul", 0, 5, long_name="m/act/Relu:_MklNativeFusedMatMul"),
              _event("MatMul", 5, 5, long_name="m/h/MatMul:_MklMatMul"),
              _event("ThreadpoolListener::Region", 0, 10)]
    assert xprof_reader.host_op_types(events) == {"m/act/Relu": "_MklNativeFusedMatMul",
                                                  "m/h/MatMul": "_MklMatMul"}


def test_dense_then_separate_relu_layer_share_one_measured_kernel(tmp_path):
    """Grappler's remapper (and oneDNN) fuse MatMul + BiasAdd + Relu on x86 CPUs, here across
    two layers: the kernel is named after the Activation layer's Relu. The Dense's
    multiply gets most of it; both layers say they share a kernel; a warning says how."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((256,))
    x = keras.layers.Dense(512, name="fc")(inputs)
    x = keras.layers.Activation("relu", name="act")(x)
    model = keras.Model(inputs, keras.layers.Dense(8, name="head")(x))
    rng = np.random.default_rng(0)
    batch = (rng.standard_normal((256, 256), dtype=np.float32),
             rng.standard_normal((256, 8), dtype=np.float32))
    m = measure_model(model, batch, batch_size=256, loss="mse", optimizer="sgd", steps=2,
                      warmup_steps=1, logdir=str(tmp_path))
    fc, act, head = m.layers
    assert fc.time_fwd_s > 0 and act.time_fwd_s > 0
    assert fc.time_fwd_s > 10 * act.time_fwd_s  # 2 x 256 multiply-adds per relu element
    assert (fc.fused_with, act.fused_with, head.fused_with) == (("act",), ("fc",), ())
    notes = [w for w in m.warnings if w.startswith("fused kernel")]
    assert len(notes) == 1 and "layers fc, act" in notes[0] and "FLOPs" in notes[0], m.warnings
    assert MeasuredProfile.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_gpu_capture_splits_a_fused_kernel(monkeypatch):
    """The GPU branch reads kernel types from framework_op_stats' type column."""
    trace = {"traceEvents": [
        {"ph": "X", "name": "measured_train_step 0", "ts": 0, "dur": 1000, "pid": 1, "tid": 1,
         "args": {"step_num": "0"}}]}
    cols = [{"id": c} for c in ("host_or_device", "type", "operation", "total_self_time")]
    stats = [{"cols": cols, "rows": [{"c": [{"v": v} for v in (
        "Device", "_FusedMatMul", "m_1/act_1/Relu", 500.0)]}]}]
    monkeypatch.setattr(xprof_reader, "tool_json",
                        lambda paths, tool: trace if tool == "trace_viewer" else stats)
    graph = [GraphOp("m_1/fc_1/MatMul", "MatMul", ("x",), 98),
             GraphOp("m_1/fc_1/BiasAdd", "BiasAdd", ("m_1/fc_1/MatMul",), 1),
             GraphOp("m_1/act_1/Relu", "Relu", ("m_1/fc_1/BiasAdd",), 1)]

    class Dense:
        pass

    class Activation:
        pass

    m = _from_capture([("fc", Dense()), ("act", Activation())],
                      {"fc": ["m_1/fc_1"], "act": ["m_1/act_1"]}, ["x.xplane.pb"], graph=graph,
                      batch_size=4, steps=1, warmup_steps=1, device="GPU:0 (test)",
                      step_time_unprofiled_s=1e-3, peak_memory_bytes=10,
                      peak_memory_source="test", logdir="/tmp", name="m")
    fc, act = m.layers
    assert (fc.time_fwd_s, act.time_fwd_s) == (pytest.approx(495e-6), pytest.approx(5e-6))
    assert fc.fused_with == ("act",) and any("_FusedMatMul" in w for w in m.warnings)
