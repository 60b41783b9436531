"""reports.images: the simulated pipeline schedule against the bubble formula, the
memory bars and the layer graph, and the images written to TensorBoard, read back."""
from __future__ import annotations

import io

import numpy as np
import pytest

from tfplan.core.presets import parse_cluster
from tfplan.planner.search import search
from tfplan.reports.images import (layer_positions, memory_bars, plan_images, plan_schedule,
                            schedule_slots)
from tests.planner.gpt_profile import gpt_profile
from tests.planner.test_search import chain_profile, make_cluster


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (3, 5), (1, 4)])
def test_schedule_bubble_equals_the_formula(schedule, p, m):
    slots = schedule_slots(p, m, schedule, 1.0, 2.0)
    assert len(slots) == 2 * p * m  # every micro-batch's forward and backward on every stage
    end = max(s.end_s for s in slots)
    assert end == pytest.approx((m + p - 1) * 3.0)  # (m + p - 1) slots of f + b
    busy = sum(s.end_s - s.start_s for s in slots)
    assert 1 - busy / (p * end) == pytest.approx((p - 1) / (m + p - 1))
    for s in slots:  # a forward waits for the previous stage, a backward for the next
        if s.kind == "F" and s.stage:
            prev = next(o for o in slots if (o.kind, o.stage, o.microbatch) ==
                        ("F", s.stage - 1, s.microbatch))
            assert s.start_s >= prev.end_s


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (3, 6, 3), (2, 6, 3)])
def test_interleaved_bubble_equals_the_formula(p, m, v):
    """v chunks per device at f/v and 2f/v: the bubble shrinks v-fold, (p - 1)/(v m + p - 1)
    of the time (Narayanan et al., SC'21, Sec. 2.2.2), in the order apply enforces."""
    slots = schedule_slots(p, m, "interleaved", 1.0, 2.0, virtual_stages=v)
    assert len(slots) == 2 * p * v * m
    assert {(s.stage, s.chunk) for s in slots} == {(d, c) for d in range(p) for c in range(v)}
    end = max(s.end_s for s in slots)
    assert end == pytest.approx(m * 3.0 + (p - 1) * 3.0 / v)
    busy = sum(s.end_s - s.start_s for s in slots)
    assert 1 - busy / (p * end) == pytest.approx((p - 1) / (v * m + p - 1))
    for d in range(p):  # each device runs its passes in planner.pipeline_order's order
        from tfplan.planner.pipeline_order import device_order
        mine = sorted((s for s in slots if s.stage == d), key=lambda s: s.start_s)
        assert [(s.kind, s.chunk * p + d, s.microbatch) for s in mine] == [
            (o.kind, o.stage, o.microbatch) for o in device_order("interleaved", d, p, v, m)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_drawn_order_is_the_one_apply_enforces(schedule):
    from tfplan.planner.pipeline_order import device_order
    p, m = 4, 6
    slots = schedule_slots(p, m, schedule, 1.0, 2.0)
    for d in range(p):
        mine = sorted((s for s in slots if s.stage == d), key=lambda s: s.start_s)
        assert [(s.kind, s.microbatch) for s in mine] == [
            (o.kind, o.microbatch) for o in device_order(schedule, d, p, 1, m)]


def test_1f1b_holds_at_most_pp_microbatches_where_gpipe_holds_all():
    def peak_in_flight(slots, stage):
        events = sorted((s.end_s if s.kind == "F" else s.start_s, 1 if s.kind == "F" else -1)
                        for s in slots if s.stage == stage)
        live = peak = 0
        for _, d in sorted(events, key=lambda e: (e[0], e[1])):
            live += d
            peak = max(peak, live)
        return peak
    assert peak_in_flight(schedule_slots(4, 8, "1f1b", 1.0, 2.0), 0) <= 4
    assert peak_in_flight(schedule_slots(4, 8, "gpipe", 1.0, 2.0), 0) == 8


def test_images_of_a_pipeline_plan_show_its_stages_and_devices():
    profile = gpt_profile(4, 512, 8, vocab=4096, seq=256)
    plan = search(profile, parse_cluster("8xA100-80GB"), 16,
                  fix={"pp": 4, "microbatch_size": 1, "schedule": "1f1b"}).chosen
    slots, m = plan_schedule(plan)
    assert m == 16 and {s.stage for s in slots} == {0, 1, 2, 3}
    per_device = dict(plan.predicted.peak_memory_bytes_per_device)
    assert memory_bars(plan) == [(f"stage {k}", max(per_device[d] for d in st.devices))
                                 for k, st in enumerate(plan.stages)]  # a bar per stage
    images = plan_images(profile, plan)
    assert set(images) == {"plan/pipeline_schedule", "plan/memory_per_stage",
                           "plan/layer_graph"}
    for image in images.values():
        assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
    # the schedule draws 4 rows of passes: at least 4 distinct non-grey colours per row
    timeline = images["plan/pipeline_schedule"]
    assert len({tuple(px) for px in timeline.reshape(-1, 3)}) > 8


def test_layer_positions_put_branches_side_by_side():
    profile = chain_profile(residual=True)
    pos = layer_positions(profile)
    assert pos[profile.layers[0].name] == (0, 0)
    columns = [c for c, _ in pos.values()]
    assert max(columns) < len(profile.layers)  # a residual skip shares columns
    assert len(set(pos.values())) == len(pos)  # no two layers on one spot


def test_write_analysis_images_read_back_with_tensorboard(tmp_path):
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tfplan.reports.tensorboard import write_analysis
    profile = chain_profile()
    result = search(profile, make_cluster(memory_bytes=10**12), 32, fix={"pp": 2})
    write_analysis(tmp_path, profile, result.chosen, result.candidates)
    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    # tf.summary.image is written as a tensor summary of encoded PNGs (TF2)
    assert {"plan/pipeline_schedule", "plan/memory_per_stage",
            "plan/layer_graph"} <= set(tags["tensors"])
    import tensorflow as tf
    chosen = result.chosen
    scalar = float(tf.make_ndarray(acc.Tensors("predicted/step_time_s")[0].tensor_proto))
    assert scalar == pytest.approx(chosen.predicted.step_time_s, rel=1e-6)
    # one chart of peak memory per pipeline stage (x = the stage), never a tag per device
    per_stage = acc.Tensors("predicted/peak_memory_bytes_per_stage")
    assert [e.step for e in per_stage] == list(range(chosen.strategy.pp))
    per_device = dict(chosen.predicted.peak_memory_bytes_per_device)
    assert [float(tf.make_ndarray(e.tensor_proto)) for e in per_stage] == pytest.approx(
        [max(per_device[d] for d in st.devices) for st in chosen.stages], rel=1e-6)
    assert not [t for t in tags["tensors"] if "device_" in t]
    text = tf.make_ndarray(acc.Tensors("plan/chosen")[0].tensor_proto).item().decode()
    assert chosen.name in text and f"pp={chosen.strategy.pp}" in text
    # the candidates' step times: a ranked table, not a scalar drawn as a line over rank
    ranked = tf.make_ndarray(acc.Tensors("candidates/step_time_s")[0].tensor_proto).item().decode()
    assert "candidates/step_time_s" not in tags["scalars"]
    assert acc.SummaryMetadata("candidates/step_time_s").plugin_data.plugin_name == "text"
    from tfplan.reports.tables import fmt_seconds, ranked_candidates
    fit, unfit = ranked_candidates(result.candidates)
    rows = [line for line in ranked.splitlines() if line.startswith("| ") and
            line[2].isdigit()]
    assert len(rows) == len(result.candidates)
    for k, (row, cand) in enumerate(zip(rows, fit + unfit), start=1):
        assert row.startswith(f"| {k} |") and cand.name in row
        assert fmt_seconds(cand.predicted.step_time_s) in row
    assert "| 1.000x |" in rows[0]
    event = acc.Tensors("plan/memory_per_stage")[0]
    width, height, png = event.tensor_proto.string_val[:3]
    image = Image.open(io.BytesIO(png))
    assert image.size == (int(width), int(height)) == (1200, 480)  # legible 16 px text


def test_a_measured_capture_is_attached_to_the_analysis_run(tmp_path):
    from tfplan.reports.tensorboard import attach_capture
    capture = tmp_path / "measure" / "plugins" / "profile" / "2026_12_02_14_00_00"
    capture.mkdir(parents=True)
    (capture / "host.xplane.pb").write_bytes(b"xplane")
    run = tmp_path / "analysis" / "tensorboard"
    copies = attach_capture(run, [str(capture / "host.xplane.pb"), str(tmp_path / "gone.pb")])
    assert copies == [str(run / "plugins" / "profile" / "2026_12_02_14_00_00" /
                          "host.xplane.pb")]
    assert (run / "plugins" / "profile" / "2026_12_02_14_00_00" / "host.xplane.pb"
            ).read_bytes() == b"xplane"


def test_an_interleaved_plan_draws_its_model_chunks():
    profile = gpt_profile(8, 512, 8, vocab=4096, seq=256)
    plan = search(profile, parse_cluster("8xA100-80GB"), 16,
                  fix={"pp": 4, "microbatch_size": 1, "schedule": "interleaved"}).chosen
    v = plan.strategy.virtual_stages
    assert plan.strategy.schedule == "interleaved" and v > 1
    slots, m = plan_schedule(plan)
    assert {(s.stage, s.chunk) for s in slots} == {(d, c) for d in range(4) for c in range(v)}
    assert len(slots) == 2 * 4 * v * m
    image = plan_images(profile, plan)["plan/pipeline_schedule"]
    assert image.dtype == np.uint8 and image.shape[2] == 3


def test_axis_ticks_are_round_numbers_up_to_the_top():
    from tfplan.reports.images import axis_ticks
    assert [t / 2**30 for t in axis_ticks(88 * 2**30, 2**30)] == [0, 20, 40, 60, 80]
    assert axis_ticks(3.03e-3) == pytest.approx([0, 1e-3, 2e-3, 3e-3])
    assert axis_ticks(1.0) == pytest.approx([0, 0.2, 0.4, 0.6, 0.8, 1.0])
