"""Writes what a profile and a plan say into a TensorBoard run.

Pipeline position: last stage. ``plan analyze --out DIR`` calls
``write_analysis(DIR/tensorboard, ...)``; open it with
``tensorboard --logdir DIR/tensorboard``. Text summaries hold the per-layer
profile, the ranked candidates and the chosen plan with its reason (markdown
tables, the same rows the terminal shows); scalars hold each candidate's
predicted step time and the chosen plan's peak memory per device; images
(``reports.images``) show the chosen plan's pipeline schedule, its memory per device
against capacity and the layer graph coloured by stage.
TensorFlow is imported here only to write summaries.
"""
from __future__ import annotations

import os
from typing import Sequence

from tfplan.core.atomic import copy_file, write_json
from tfplan.planner import cost_model as cm
from tfplan.planner.plan import Plan
from tfplan.profiler.model_profile import ModelProfile
from tfplan.reports.images import memory_bars, plan_images, plan_schedule
from tfplan.reports.tables import (CANDIDATE_HEADER, PROFILE_HEADER, candidate_rows, fmt_bytes,
                            fmt_seconds, markdown_table, profile_rows)


def plan_markdown(plan: Plan) -> str:
    """The chosen plan in a few lines of markdown."""
    s, p = plan.strategy, plan.predicted
    lines = [f"**{plan.name}** for model `{plan.model_name}` on `{plan.cluster.name}`, "
             f"global batch {plan.global_batch}", "",
             f"- {s.describe()}",
             f"- predicted step time {fmt_seconds(p.step_time_s)}, "
             f"{p.samples_per_s:,.1f} samples/s",
             f"- peak memory per device {fmt_bytes(p.max_memory_bytes)} of "
             f"{fmt_bytes(p.memory_capacity_bytes)}",
             f"- why: {plan.reason}" if plan.reason else "", ""]
    lines.append(markdown_table(("stage", "devices", "layers"), [
        (str(i), ", ".join(st.devices), ", ".join(st.layers)) for i, st in enumerate(plan.stages)]))
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
        for i, (device, nbytes) in enumerate(chosen.predicted.peak_memory_bytes_per_device):
            tf.summary.scalar(f"predicted/peak_memory_bytes/device_{i}", float(nbytes), step=0,
                              description=device)
        for tag, image in plan_images(profile, chosen).items():
            tf.summary.image(tag, image[None], step=0)
        for rank, cand in enumerate(candidates):
            # One point per candidate, x = rank: a bar chart of the ranking.
            tf.summary.scalar("candidates/step_time_s", cand.predicted.step_time_s, step=rank,
                              description=cand.name)
    writer.flush()
    writer.close()
    write_plugin_analysis(logdir, profile, chosen, candidates, run_id=run_id)
    return logdir


def plugin_analysis(profile: ModelProfile, chosen: Plan, candidates: Sequence[Plan]) -> dict:
    """What the "Parallel plan" dashboard shows for one run (``reports.plugin``): the
    plans, per-layer rows (with the cost model's time per micro-batch on the plan's
    device), the simulated pipeline schedule and the memory bars."""
    s, device = chosen.strategy, chosen.cluster.device
    where = chosen.device_of_layer()
    stage_of = {name: k % s.pp for k, st in enumerate(chosen.stages) for name in st.layers}
    layers = []
    for l in profile.layers:
        fwd, bwd = cm.layer_fwd_bwd_time_s(l, s.microbatch_size, profile.batch_size, device,
                                           profile.precision,
                                           measured_batch_size=profile.measured_batch_size)
        layers.append({
            "name": l.name, "type": l.type, "params": l.params,
            "flops": (l.flops_fwd + l.flops_bwd) / profile.batch_size * s.microbatch_size,
            "memory_bytes": l.state_bytes + l.activation_saved_bytes / profile.batch_size
            * s.microbatch_size,
            "time_s": fwd + bwd, "stage": stage_of.get(l.name), "device": where.get(l.name)})
    slots, m = plan_schedule(chosen)
    return {
        "plan": chosen.to_dict(), "candidates": [c.to_dict() for c in candidates],
        "layers": layers,
        "schedule": {"num_microbatches": m, "slots": [
            {"stage": x.stage, "microbatch": x.microbatch, "kind": x.kind,
             "start_s": x.start_s, "end_s": x.end_s} for x in slots]},
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
