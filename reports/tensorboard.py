"""Writes what a profile and a plan say into a TensorBoard run.

Pipeline position: last stage. ``plan analyze --out DIR`` calls
``write_analysis(DIR/tensorboard, ...)``; open it with
``tensorboard --logdir DIR/tensorboard``. Text summaries hold the per-layer
profile, the ranked candidates and the chosen plan with its reason (markdown
tables, the same rows the terminal shows; devices named as ranges per pipeline stage,
``reports.device_groups``) and, in ``candidates/step_time_s``, the candidates' predicted
step times by rank (a table, not a chart: ``candidate_step_times`` says why); scalars
hold the chosen plan's step time, samples/s, model TFLOP/s per device, MFU and peak
memory, and its peak memory per pipeline stage (one chart, x = the stage): six tags
whatever the cluster size. Images (``reports.images``) show the chosen plan's pipeline
schedule, its memory per stage against capacity and the layer graph coloured by stage.
``analysis.json`` (``plugin_analysis``) holds the same per stage, never per device, so
its size does not grow with the device count.
TensorFlow is imported here only to write summaries.
"""
from __future__ import annotations

import os
from typing import Sequence

from tfplan.core.atomic import copy_file, write_json
from tfplan.planner.plan import Plan
from tfplan.planner.traffic import KINDS
from tfplan.profiler.model_profile import ModelProfile
from tfplan.reports.device_groups import mesh, stage_groups
from tfplan.reports.layer_table import FIELDS as LAYER_FIELDS, layer_table
from tfplan.reports.images import memory_bars, plan_images, plan_schedule
from tfplan.reports.tables import (CANDIDATE_HEADER, PROFILE_HEADER, candidate_rows, fmt_bytes,
                            fmt_fraction, fmt_seconds, fmt_tflops, markdown_table, mfu,
                            profile_rows, ranked_candidates)


def plan_markdown(plan: Plan) -> str:
    """The chosen plan in a few lines of markdown: one row per pipeline stage, its devices
    named as ranges (``reports.device_groups``), never one by one."""
    s, p = plan.strategy, plan.predicted
    groups = stage_groups(plan)
    v = len(plan.stages) // max(1, len(groups))
    lines = [f"**{plan.name}** for model `{plan.model_name}` on `{plan.cluster.name}` "
             f"({len(plan.devices):,} devices), global batch {plan.global_batch}", "",
             f"- {s.describe()}",
             f"- predicted step time {fmt_seconds(p.step_time_s)}, "
             f"{p.samples_per_s:,.1f} samples/s, "
             f"{fmt_tflops(p.model_tflops_per_device)} model TFLOP/s per device "
             f"(MFU {fmt_fraction(mfu(plan))})",
             f"- peak memory per device {fmt_bytes(p.max_memory_bytes)} of "
             f"{fmt_bytes(p.memory_capacity_bytes)}",
             f"- why: {plan.reason}" if plan.reason else "", ""]
    lines.append(markdown_table(
        ("stage", "devices", "layers", "peak memory per device"),
        [(str(g.stage), f"{len(g.devices)}: {g.where}",
          f"{g.layers}" + (f" in {v} chunks" if v > 1 else f" ({g.first_layer} .. "
                                                             f"{g.last_layer})"),
          fmt_bytes(g.peak_memory_bytes) if g.min_memory_bytes == g.peak_memory_bytes
          else f"{fmt_bytes(g.min_memory_bytes)} .. {fmt_bytes(g.peak_memory_bytes)}")
         for g in groups]))
    return "\n".join(lines)


def write_analysis(logdir: str | os.PathLike, profile: ModelProfile, chosen: Plan,
                   candidates: Sequence[Plan], run_id: str | None = None) -> str:
    """Write one TensorBoard run under ``logdir``; return the logdir. ``run_id``: the
    ``plan analyze`` run it belongs to, recorded in its analysis.json."""
    import tensorflow as tf

    logdir = os.fspath(logdir)
    os.makedirs(logdir, exist_ok=True)
    writer = tf.summary.create_file_writer(logdir)
    with writer.as_default():
        tf.summary.text("profile/layers", markdown_table(PROFILE_HEADER, profile_rows(profile)),
                        step=0)
        tf.summary.text("plan/candidates",
                        markdown_table(CANDIDATE_HEADER, candidate_rows(candidates, chosen)),
                        step=0)
        tf.summary.text("plan/chosen", plan_markdown(chosen), step=0)
        tf.summary.scalar("predicted/step_time_s", chosen.predicted.step_time_s, step=0)
        tf.summary.scalar("predicted/samples_per_s", chosen.predicted.samples_per_s, step=0)
        tf.summary.scalar("predicted/model_tflops_per_device",
                          chosen.predicted.model_tflops_per_device, step=0)
        tf.summary.scalar("predicted/mfu", mfu(chosen), step=0,
                          description="model FLOPs utilisation: model FLOP/s per device over "
                                      "the device's peak")
        tf.summary.scalar("predicted/peak_memory_bytes", float(chosen.predicted.max_memory_bytes),
                          step=0, description="the largest peak over the plan's devices")
        for g in stage_groups(chosen):
            # one chart, x = the pipeline stage: a tag per device would not scale
            tf.summary.scalar("predicted/peak_memory_bytes_per_stage",
                              float(g.peak_memory_bytes), step=g.stage,
                              description="peak memory per device of each pipeline stage "
                                          "(x = the stage)")
        for tag, image in plan_images(profile, chosen).items():
            tf.summary.image(tag, image[None], step=0)
        tf.summary.text("candidates/step_time_s", candidate_step_times(candidates, chosen),
                        step=0)
    writer.flush()
    writer.close()
    write_plugin_analysis(logdir, profile, chosen, candidates, run_id=run_id)
    return logdir


def candidate_step_times(candidates: Sequence[Plan], chosen: Plan) -> str:
    """The candidates' predicted step times as a markdown table, ranked (the ones that fit
    by step time, then the ones that do not): rank, strategy, step time, how many times
    the fastest that fits, fits.

    A text table, not a scalar: TensorBoard's Scalars tab draws every scalar tag as a
    line over its steps, smoothed by default, and has no bar chart. With x = a
    candidate's rank it drew a curve through categories that have no order in between
    (rank 2.5 is not a plan) and its smoothing mixed neighbours' times, so the chart
    showed a trend that does not exist. Ranks are categories: a table says it plainly,
    and the ``plan/candidates`` table carries the rest of their columns."""
    fit, unfit = ranked_candidates(candidates)
    fastest = fit[0].predicted.step_time_s if fit else None
    rows = [(str(k), ("* " if c.name == chosen.name else "") + c.name,
             fmt_seconds(c.predicted.step_time_s),
             f"{c.predicted.step_time_s / fastest:.3f}x" if fastest else "-",
             "yes" if c.predicted.fits else "NO")
            for k, c in enumerate(fit + unfit, start=1)]
    return markdown_table(("rank", "strategy", "predicted step time", "over the fastest "
                           "that fits", "fits"), rows)


def plan_summary(plan: Plan, detail: bool = True) -> dict:
    """``plan.to_dict()`` without what grows with the device count or the model, for
    ``analysis.json``: ``stages`` is one ``StageGroup`` per pipeline stage (devices as a
    count and ranges, layers as a count), ``predicted`` holds the largest peak
    (``peak_memory_bytes``) instead of the per-device map and each pipeline stage's busiest
    device's bytes sent by kind (``sent_bytes_per_stage``), and the model signature and
    tp splits become counts. ``detail=False`` (a candidate) also drops the cluster (the
    chosen plan's) and keeps the cluster's name only."""
    d = plan.to_dict()
    d["model"] = {"name": plan.model_name, "fingerprint": plan.model_fingerprint,
                  "layers": len(plan.model_signature)}
    predicted = d["predicted"]
    del predicted["peak_memory_bytes_per_device"]
    predicted["peak_memory_bytes"] = plan.predicted.max_memory_bytes
    if predicted.pop("sent_bytes_per_device", None) is not None:  # per stage: its busiest
        sent = {device: dict(kinds) for device, kinds in plan.predicted.sent_bytes_per_device}
        pp = max(1, min(plan.strategy.pp, len(plan.stages)))
        predicted["sent_bytes_per_stage"] = [
            {kind: max((sent.get(device, {}).get(kind, 0) for device in plan.stages[k].devices),
                       default=0) for kind in KINDS} for k in range(pp)]
    predicted["mfu"] = mfu(plan)
    d["stages"] = [g.to_dict() for g in stage_groups(plan)]
    d["devices"] = len(plan.devices)
    d["tp_splits"] = len(plan.tp_splits)
    if detail:
        d["mesh"] = mesh(plan)
    else:
        d["cluster"] = {"name": plan.cluster.name}
    return d


SLOT_FIELDS = ("stage", "microbatch", "kind", "chunk", "start_s", "end_s")  # analysis.json


def _round(x: float) -> float:
    return float(f"{x:.6g}")


def plugin_analysis(profile: ModelProfile, chosen: Plan, candidates: Sequence[Plan]) -> dict:
    """What the "Parallel plan" dashboard shows for one run (``reports.plugin``): the
    plans (``plan_summary``: per pipeline stage, never per device), per-layer rows of the
    chosen plan as it runs them (``layers``) and the layer tables of the chosen plan and
    the runner-up with their stage totals (``layer_tables``, ``reports.layer_table``), the
    simulated pipeline schedule and the memory bars (one per stage)."""
    where = chosen.device_of_layer()
    # the layer table as each plan runs it (reports.layer_table): the chosen plan's, and
    # the runner-up's to compare
    tables = [layer_table(profile, chosen)] + [
        layer_table(profile, c) for c in [c for c in candidates if c.name != chosen.name][:1]]
    layers = [dict(zip(LAYER_FIELDS, row), device=where.get(row[0]))
              for row in tables[0]["rows"]]
    slots, m = plan_schedule(chosen)
    return {
        "plan": plan_summary(chosen),
        "candidates": [plan_summary(c, detail=False) for c in candidates],
        "layers": layers,
        "layer_tables": tables,
        # slots as rows of SLOT_FIELDS: thousands of them in a long interleaved pipeline
        "schedule": {"num_microbatches": m, "drawn_microbatches": 1 + max(
            (x.microbatch for x in slots), default=-1), "fields": list(SLOT_FIELDS), "slots": [
            [x.stage, x.microbatch, x.kind, x.chunk, _round(x.start_s), _round(x.end_s)]
            for x in slots]},
        "memory": [{"label": label, "bytes": n} for label, n in memory_bars(chosen)],
    }


def write_plugin_analysis(logdir: str | os.PathLike, profile: ModelProfile, chosen: Plan,
                          candidates: Sequence[Plan], run_id: str | None = None) -> str:
    """Write ``plugin_analysis`` where the plugin finds it (``reports.plugin``), atomically,
    with the model fingerprint and the ``plan analyze`` run id (when given)."""
    from tfplan.reports.plugin import analysis_path
    path = analysis_path(os.fspath(logdir))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    doc = plugin_analysis(profile, chosen, candidates)
    doc["fingerprint"] = profile.fingerprint
    if run_id is not None:
        doc["run_id"] = run_id
    write_json(path, doc, indent=None)
    return path


def attach_capture(logdir: str | os.PathLike, trace_files: Sequence[str]) -> list[str]:
    """Copy a measured run's XProf capture (``MeasuredProfile.trace_files``, each
    ``.../plugins/profile/<run>/<host>.xplane.pb``) under ``logdir/plugins/profile`` so the
    Profile tab shows it in the same TensorBoard run as the plan; return the copies.
    Files that no longer exist are skipped."""
    out = []
    for path in trace_files:
        if not os.path.isfile(path):
            continue
        run = os.path.basename(os.path.dirname(path))
        dest_dir = os.path.join(os.fspath(logdir), "plugins", "profile", run)
        os.makedirs(dest_dir, exist_ok=True)
        dest = os.path.join(dest_dir, os.path.basename(path))
        copy_file(path, dest)
        out.append(dest)
    return out
