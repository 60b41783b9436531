"""apply.monitor.PlanMonitor: predicted and measured step times written per step,
read back with TensorBoard's event reader."""
from __future__ import annotations

import keras
import numpy as np
import pytest

from tfplan.planner.search import search
from tfplan.apply.monitor import PlanMonitor
from tests.planner.test_search import chain_profile, make_cluster


def test_monitor_writes_predicted_and_measured_per_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    plan = search(chain_profile(), make_cluster(memory_bytes=10**12), 8, fix={"dp": 1}).chosen
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    monitor = PlanMonitor(plan, tmp_path, warmup_steps=1)
    x, y = np.ones((40, 4), "float32"), np.zeros((40, 3), "float32")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[monitor])
    assert len(monitor.step_times_s) == 4  # 5 steps, the first (tracing) not written
    acc = EventAccumulator(str(tmp_path / "train"), size_guidance={"tensors": 0})
    acc.Reload()
    import tensorflow as tf

    def values(tag):
        return [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
    measured = values("measured/step_time_s")
    assert [s for s, _ in measured] == [2, 3, 4, 5]
    assert [v for _, v in measured] == pytest.approx(monitor.step_times_s, rel=1e-6)
    predicted = values("predicted/step_time_s")
    assert [v for _, v in predicted] == pytest.approx([plan.predicted.step_time_s] * 4)
    ratios = values("measured/over_predicted")
    assert ratios[0][1] == pytest.approx(measured[0][1] / plan.predicted.step_time_s, rel=1e-5)
    samples = values("measured/samples_per_s")
    assert samples[0][1] == pytest.approx(8 / measured[0][1], rel=1e-5)
    # one chart with both step times: the Custom Scalars layout, read back as TensorBoard
    # reads it, names a tag pattern that matches the measured and the predicted tag
    import re
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata
    layout = layout_pb2.Layout()
    layout.ParseFromString(acc.Tensors(metadata.CONFIG_SUMMARY_TAG)[0].tensor_proto
                           .string_val[0])
    chart = layout.category[0].chart[0]
    tags = [t for t in acc.Tags()["tensors"]
            if any(re.fullmatch(p, t) for p in chart.multiline.tag)]
    assert sorted(tags) == ["measured/step_time_s", "predicted/step_time_s"]


def test_wrap_with_a_logdir_monitors_fit(tmp_path):
    from tfplan import apply
    from tests.apply.helpers import base_model, batches_of, cpus, fresh_optimizer, make_plan

    module, model = base_model("tiny_mlp")
    plan = make_plan(model, [cpus(0)], global_batch=16)
    wrapped = apply.wrap(model, plan, logdir=tmp_path)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    (x, y), = batches_of(module, 1, 64)
    wrapped.fit(x, y, batch_size=16, epochs=1, verbose=0)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "train"), size_guidance={"tensors": 0})
    acc.Reload()
    assert len(acc.Tensors("measured/step_time_s")) == 3  # 4 steps, the first not written
    assert (tmp_path / "plan.json").is_file()
