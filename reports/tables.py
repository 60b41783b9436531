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
                    "capacity", "fits", "samples/s", "TFLOP/s/dev", "MFU")
# What the terminal shows without --wide: every number whole in 80 columns.
SHORT_HEADER = ("", "#", "strategy", "step time", "TFLOP/s/dev", "MFU", "peak mem / device",
                "fits")
# Columns that hold text (left-aligned, may wrap); every other one is a number, never cut.
TEXT_COLUMNS = ("strategy",)


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


def peak_flops_per_s(plan: Plan) -> float:
    """The device's peak dense FLOP/s at the plan's precision (TF32 for float32 where the
    device has it: ``DeviceSpec.peak_flops``, the figure the cost model prices matmuls at)."""
    return plan.cluster.device.peak_flops(plan.precision)


def mfu(plan: Plan) -> float:
    """Model FLOPs utilisation: MFU = F_model / t_step / d / P_peak, the plan's predicted
    model FLOP/s per device over the device's peak (Chowdhery et al., PaLM, 2022, App. B:
    recomputation not counted)."""
    return plan.predicted.model_tflops_per_device * 1e12 / peak_flops_per_s(plan)


def fmt_tflops(tflops: float) -> str:
    """TFLOP/s with three significant digits: 312 -> '312', 0.01824 -> '0.0182'."""
    return f"{tflops:.0f}" if tflops >= 100 else f"{tflops:.3g}"


def fmt_fraction(x: float) -> str:
    """A fraction as a percentage: 0.4213 -> '42.1%', 0.000412 -> '0.041%'."""
    return f"{100 * x:.1f}%" if x >= 0.01 else f"{100 * x:.2g}%"


def ranked_candidates(candidates: Sequence[Plan]) -> tuple[list[Plan], list[Plan]]:
    """(the ones that fit, the ones that do not), each by predicted step time.

    The search lists the chosen plan first even where a simpler plan won on the
    simplicity rule over a faster one; a "ranked" listing ranks it where its time puts it.
    """
    key = lambda p: (p.predicted.step_time_s, p.strategy.num_devices, p.name)  # noqa: E731
    return (sorted((p for p in candidates if p.predicted.fits), key=key),
            sorted((p for p in candidates if not p.predicted.fits), key=key))


def candidate_rows(candidates: Sequence[Plan], chosen: Plan,
                   header: Sequence[str] = CANDIDATE_HEADER, first_rank: int = 1,
                   ranked: bool = True) -> list[tuple[str, ...]]:
    """One row per candidate plan with ``header``'s columns (``CANDIDATE_HEADER``,
    ``SHORT_HEADER`` or any subset), ranked by predicted step time (the ones that fit
    first; ``ranked=False``: as given) and numbered from ``first_rank``; the chosen one
    is marked with '*' wherever it ranks."""
    if ranked:
        fitting, not_fitting = ranked_candidates(candidates)
        candidates = fitting + not_fitting
    rows = []
    for rank, p in enumerate(candidates, first_rank):
        s, pr, b = p.strategy, p.predicted, p.predicted.breakdown
        cells = {
            "": "*" if p.name == chosen.name else "", "#": str(rank), "strategy": p.name,
            "dp": str(s.dp), "tp": str(s.tp), "pp": str(s.pp),
            "micro-batches": f"{s.num_microbatches} x {s.microbatch_size}",
            "step time": fmt_seconds(pr.step_time_s), "compute": fmt_seconds(b.compute_s),
            "comm": fmt_seconds(b.communication_s), "bubble": fmt_seconds(b.bubble_s),
            "recompute": fmt_seconds(b.recompute_s), "optimizer": fmt_seconds(b.optimizer_s),
            "overhead": fmt_seconds(b.overhead_s),
            "peak mem / device": fmt_bytes(pr.max_memory_bytes),
            "capacity": fmt_bytes(pr.memory_capacity_bytes), "fits": "yes" if pr.fits else "NO",
            "samples/s": f"{pr.samples_per_s:,.1f}",
            "TFLOP/s/dev": fmt_tflops(pr.model_tflops_per_device), "MFU": fmt_fraction(mfu(p)),
        }
        rows.append(tuple(cells[h] for h in header))
    return rows


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """GitHub-flavoured markdown, as TensorBoard's text plugin renders it."""
    esc = lambda c: str(c).replace("|", "\\|") or " "  # noqa: E731
    lines = ["| " + " | ".join(esc(h) for h in header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
