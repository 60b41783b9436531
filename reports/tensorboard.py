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

from planner.plan import Plan
from profiler.model_profile import ModelProfile
from reports.tables import (CANDIDATE_HEADER, PROFILE_HEADER, candidate_rows, fmt_bytes,
                            fmt_seconds, markdown_table, profile_rows)


def plan_markdown(plan: Plan) -> str:
    """The chosen plan in a few lines of markdown."""
    s, p = plan.strategy, plan.predicted
    lines = [f"**{plan.name}** for model `{plan.model_name}` on `{plan.cluster.name}`, "
             f"global batch {plan.global_batch}", "",
             f"- dp={s.dp}, tp={s.tp}, pp={s.pp}, {s.num_microbatches} micro-batches of "
             f"{s.microbatch_size}, schedule {s.schedule}",
             f"- predicted step time {fmt_seconds(p.step_time_s)}, "
             f"{p.samples_per_s:,.1f} samples/s",
             f"- peak memory per device {fmt_bytes(p.max_memory_bytes)} of "
             f"{fmt_bytes(p.memory_capacity_bytes)}",
             f"- why: {plan.reason}" if plan.reason else "", ""]
    lines.append(markdown_table(("stage", "devices", "layers"), [
        (str(i), ", ".join(st.devices), ", ".join(st.layers)) for i, st in enumerate(plan.stages)]))
    return "\n".join(lines)


def write_analysis(logdir: str | os.PathLike, profile: ModelProfile, chosen: Plan,
                   candidates: Sequence[Plan]) -> str:
    """Write one TensorBoard run under ``logdir``; return the logdir."""
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
        from reports.images import plan_images
        for tag, image in plan_images(profile, chosen).items():
            tf.summary.image(tag, image[None], step=0)
        for rank, cand in enumerate(candidates):
            # One point per candidate, x = rank: a bar chart of the ranking.
            tf.summary.scalar("candidates/step_time_s", cand.predicted.step_time_s, step=rank,
                              description=cand.name)
    writer.flush()
    writer.close()
    return logdir
