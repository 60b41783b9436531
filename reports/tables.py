"""Rows of the tables every front end shows: the per-layer profile and the ranked plans.

Pipeline position: last stage, pure (no TensorFlow). The CLI renders these rows
with rich; ``reports.tensorboard`` renders the same rows as markdown text
summaries, so the terminal and TensorBoard always say the same thing.
Units: bytes and seconds come in; human units (KiB..GiB, ms, GFLOP) go out.
"""
from __future__ import annotations

from typing import Sequence

from tfplan.planner.plan import Plan
from tfplan.core.units import fmt_bytes, fmt_count, fmt_seconds  # noqa: F401  (re-exported)
from tfplan.profiler.measured_profile import MeasuredProfile
from tfplan.profiler.model_profile import ModelProfile

PROFILE_HEADER = ("layer", "type", "params", "param bytes", "activation bytes",
                  "fwd FLOPs", "bwd FLOPs")
CANDIDATE_HEADER = ("", "#", "strategy", "dp", "tp", "pp", "micro-batches", "step time",
                    "compute", "comm", "bubble", "recompute", "optimizer", "overhead",
                    "peak mem / device",
                    "capacity", "fits", "samples/s")


def profile_rows(profile: ModelProfile) -> list[tuple[str, ...]]:
    """One row per layer, then a totals row."""
    rows = [(l.name, l.type, f"{l.params:,}", fmt_bytes(l.param_bytes),
             fmt_bytes(l.activation_bytes), fmt_count(l.flops_fwd) + ("*" if l.not_counted else ""),
             fmt_count(l.flops_bwd)) for l in profile.layers]
    rows.append(("TOTAL", "", f"{profile.params:,}", fmt_bytes(profile.param_bytes),
                 fmt_bytes(profile.activation_bytes), fmt_count(profile.flops_fwd),
                 fmt_count(profile.flops_bwd)))
    return rows


MEASURED_HEADER = ("layer", "forward", "backward", "share of step")


def measured_rows(measured: MeasuredProfile) -> list[tuple[str, ...]]:
    """Measured time per layer and per step, then what ran outside the layers.

    A layer whose ops ran in one fused kernel with other layers' names them; the
    warnings under the table (``measured_summary``) say how the kernel's time was split.
    """
    step = measured.step_time_s
    share = lambda t: f"{100 * t / step:.1f}%" if step > 0 else "-"  # noqa: E731
    rows = [(l.name + (f" (kernel shared with {', '.join(l.fused_with)})"
                       if l.fused_with else ""),
             fmt_seconds(l.time_fwd_s), fmt_seconds(l.time_bwd_s), share(l.time_s))
            for l in measured.layers]
    rows.append(("outside layers (loss, optimizer, ...)", "", "",
                 share(measured.unattributed_time_s)))
    rows.append(("idle (no op running)", "", "", share(measured.idle_time_s)))
    rows.append(("STEP", "", "", fmt_seconds(step)))
    return rows


def measured_summary(measured: MeasuredProfile) -> list[str]:
    """The lines under the measured table: step time, memory and where the capture is."""
    return [
        f"Step time {fmt_seconds(measured.step_time_s)} while profiled "
        f"({fmt_seconds(measured.step_time_unprofiled_s)} unprofiled); layers account for "
        f"{100 * measured.attributed_fraction:.0f}% of it, all ops for "
        f"{100 * measured.op_fraction:.0f}%.",
        f"Peak memory {fmt_bytes(measured.peak_memory_bytes)} ({measured.peak_memory_source}).",
        f"Capture: tensorboard --logdir {measured.logdir} (Profile tab).",
    ] + [f"warning: {w}" for w in measured.warnings]


def candidate_rows(candidates: Sequence[Plan], chosen: Plan) -> list[tuple[str, ...]]:
    """One row per candidate plan, ranked as given; the chosen one is marked with '*'."""
    rows = []
    for rank, p in enumerate(candidates, 1):
        s, pr, b = p.strategy, p.predicted, p.predicted.breakdown
        rows.append((
            "*" if p.name == chosen.name else "", str(rank), p.name, str(s.dp), str(s.tp),
            str(s.pp), f"{s.num_microbatches} x {s.microbatch_size}",
            fmt_seconds(pr.step_time_s), fmt_seconds(b.compute_s),
            fmt_seconds(b.communication_s), fmt_seconds(b.bubble_s),
            fmt_seconds(b.recompute_s), fmt_seconds(b.optimizer_s),
            fmt_seconds(b.overhead_s), fmt_bytes(pr.max_memory_bytes),
            fmt_bytes(pr.memory_capacity_bytes), "yes" if pr.fits else "NO",
            f"{pr.samples_per_s:,.1f}"))
    return rows


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """GitHub-flavoured markdown, as TensorBoard's text plugin renders it."""
    esc = lambda c: str(c).replace("|", "\\|") or " "  # noqa: E731
    lines = ["| " + " | ".join(esc(h) for h in header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
