"""profiler.calibrate and the cost model's measured-time pricing: a static profile
calibrated with a one-device measurement is priced from the measured layer times, the
loss charged to the last layer, the framework's per-step overhead added once."""
from __future__ import annotations

import dataclasses

import pytest

from tfplan.planner import cost_model as cm
from tfplan.core.errors import PlannerError
from tfplan.core.presets import parse_cluster
from tfplan.planner.search import search
from tfplan.profiler.calibrate import non_optimizer_unattributed_s, with_measured_times
from tfplan.profiler.measured_profile import LayerTime, MeasuredProfile
from tests.planner.test_search import chain_profile

MS = 1e-3


def _measured(profile, batch=64, **changes):
    layers = tuple(LayerTime(l.name, l.type, time_fwd_s=(i + 1) * MS, time_bwd_s=2 * (i + 1) * MS)
                   for i, l in enumerate(profile.layers))
    m = MeasuredProfile(
        model_name=profile.model_name, batch_size=batch, steps=5, warmup_steps=1,
        device="CPU:0", time_source="test", step_time_s=0.05, step_time_unprofiled_s=0.056,
        layers=layers, unattributed_time_s=0.004, idle_time_s=0.001, peak_memory_bytes=1,
        peak_memory_source="test", logdir="", trace_files=(),
        unattributed=(("sparse_categorical_crossentropy", 0.003), ("adam", 0.0008),
                      ("gradient_tape/sparse_categorical_crossentropy", 0.0002)))
    return dataclasses.replace(m, **changes)


def test_measured_times_go_to_their_layers_and_the_loss_to_the_last():
    profile = chain_profile(n_layers=3)
    measured = _measured(profile)
    assert non_optimizer_unattributed_s(measured, "adam") == pytest.approx(0.0032)
    got = with_measured_times(profile, measured)
    assert (got.measured_device, got.measured_batch_size) == ("CPU:0", 64)
    assert [l.measured_bwd_s for l in got.layers] == pytest.approx([2 * MS, 4 * MS, 6 * MS])
    assert [l.measured_fwd_s for l in got.layers] == pytest.approx([MS, 2 * MS, 3 * MS + 0.0032])
    # unprofiled - profiled step (6 ms) + idle (1 ms)
    assert got.measured_step_overhead_s == pytest.approx(0.007)
    from tfplan.profiler.model_profile import ModelProfile
    assert ModelProfile.from_dict(got.to_dict()) == got  # survives profile.json


def test_a_measurement_of_another_model_is_refused_naming_the_layer():
    profile = chain_profile(n_layers=3)
    short = _measured(profile)
    short = dataclasses.replace(short, layers=short.layers[:2])
    with pytest.raises(PlannerError, match=f"no time for layer '{profile.layers[2].name}'"):
        with_measured_times(profile, short)
    with pytest.raises(PlannerError, match="of model 'other'"):
        with_measured_times(profile, _measured(profile, model_name="other"))


def test_measured_layers_scale_with_samples_around_the_fixed_overhead():
    profile = with_measured_times(chain_profile(n_layers=3), _measured(chain_profile(n_layers=3)))
    layer, cpu = profile.layers[1], parse_cluster("cpu:4").device
    half = cm.layer_overhead_s(cpu) / 2
    fwd, bwd = cm.layer_fwd_bwd_time_s(layer, 64, profile.batch_size, cpu, "float32",
                                       measured_batch_size=64)
    assert (fwd, bwd) == pytest.approx((2 * MS, 4 * MS))  # at the measured batch: as measured
    fwd, _ = cm.layer_fwd_bwd_time_s(layer, 16, profile.batch_size, cpu, "float32",
                                     measured_batch_size=64)
    assert fwd == pytest.approx(half + (2 * MS - half) / 4)
    fwd, _ = cm.layer_fwd_bwd_time_s(layer, 64, profile.batch_size, cpu, "float32", divide=2,
                                     measured_batch_size=64)
    assert fwd == pytest.approx(half + (2 * MS - half) / 2)


def test_a_calibrated_single_device_step_is_the_measured_layers_plus_overhead_and_update():
    base = chain_profile(n_layers=3)
    profile = with_measured_times(base, _measured(base))
    cluster = parse_cluster("cpu:4")
    plan = search(profile, cluster, 64, fix={"dp": 1}).chosen
    b = plan.predicted.breakdown
    layers_s = sum(l.measured_fwd_s + l.measured_bwd_s for l in profile.layers)
    assert b.compute_s == pytest.approx(layers_s)
    assert b.overhead_s == pytest.approx(0.007)
    assert plan.predicted.step_time_s == pytest.approx(layers_s + 0.007 + b.optimizer_s)
    # the uncalibrated profile knows no overhead and prices by roofline
    assert search(base, cluster, 64, fix={"dp": 1}).chosen.predicted.breakdown.overhead_s == 0
