"""Pictures of a plan for TensorBoard's Images tab: the pipeline schedule, memory per
pipeline stage against capacity, and the layer graph coloured by stage.

Pipeline position: ``reports.tensorboard.write_analysis`` calls ``plan_images`` and
writes each as an image summary. The drawing data comes first, as plain values the
tests check (``schedule_slots``, ``memory_bars``, ``layer_positions``); the pictures
are drawn from it with Pillow (a TensorBoard dependency), as uint8 RGB arrays.

The schedule is simulated, not measured: every stage takes the same forward time f
and backward time 2f per micro-batch (the backward pass does about twice the forward
FLOPs: Narayanan et al., SC'21, Sec. 5.1), with f + 2f = the slowest stage's time per
micro-batch in the plan's prediction. Each device runs its operations in the order its
schedule fixes -- GPipe: all forwards, then all backwards (Huang et al., 2019); 1F1B:
pp - s - 1 warm-up forwards, then one forward / one backward (Narayanan et al., SC'21,
Sec. 2.2.1); interleaved 1F1B: each device holds v model chunks of 1/v of its layers
(f/v and 2f/v per chunk and micro-batch) and runs them in ``planner.pipeline_order``'s
order (Sec. 2.2.2), the order ``apply`` enforces -- each pass as soon as its input is
ready. Idle gaps are the bubble: (p - 1)/(m + p - 1) of the time for GPipe and 1F1B,
(p - 1)/(v m + p - 1) interleaved.
"""
from __future__ import annotations

from dataclasses import dataclass
import numpy as np

from tfplan.planner.pipeline_order import device_order
from tfplan.planner.plan import Plan
from tfplan.profiler.model_profile import ModelProfile

PALETTE = ((66, 133, 244), (52, 168, 83), (251, 188, 5), (234, 67, 53), (171, 71, 188),
           (0, 172, 193), (255, 112, 67), (158, 157, 36), (92, 107, 192), (240, 98, 146))
BACKGROUND, GRID, TEXT, IDLE = (255, 255, 255), (220, 220, 220), (33, 33, 33), (236, 236, 236)
MAX_DRAWN_MICROBATCHES = 32  # a longer schedule is drawn with this many micro-batches


@dataclass(frozen=True)
class Slot:
    """One forward or backward pass of one micro-batch on one pipeline stage."""

    stage: int  # the pipeline device (row)
    microbatch: int
    kind: str  # "F" or "B"
    start_s: float
    end_s: float
    chunk: int = 0  # interleaved: which of the device's model chunks


def _order(schedule: str, stage: int, stages: int, m: int) -> list[tuple[str, int, int]]:
    """Device ``stage``'s passes as (kind, model chunk, micro-batch), chunk = the device
    for GPipe and 1F1B."""
    if stages == 1:  # gradient accumulation: each backward right after its forward
        return [(kind, 0, i) for i in range(m) for kind in ("F", "B")]
    if schedule == "gpipe":
        return [("F", stage, i) for i in range(m)] + [("B", stage, i) for i in range(m)]
    warm = min(stages - stage - 1, m)
    order = [("F", stage, i) for i in range(warm)]
    for i in range(warm, m):
        order += [("F", stage, i), ("B", stage, i - warm)]
    order += [("B", stage, i) for i in range(m - warm, m)]
    return order


def schedule_slots(stages: int, microbatches: int, schedule: str, forward_s: float,
                   backward_s: float, virtual_stages: int = 1) -> list[Slot]:
    """Every forward and backward pass of a pipeline step (see the module docstring).

    ``stages``: pipeline devices; ``virtual_stages`` (interleaved): model chunks per
    device, each taking 1/v of ``forward_s`` and ``backward_s``."""
    v = virtual_stages if schedule == "interleaved" else 1
    if v > 1:
        orders = [[(sl.kind, sl.stage, sl.microbatch) for sl in
                   device_order("interleaved", d, stages, v, microbatches)]
                  for d in range(stages)]
    else:
        orders = [_order(schedule, s, stages, microbatches) for s in range(stages)]
    chunks = stages * v  # model chunk k runs on device k % stages
    f, b = forward_s / v, backward_s / v
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * stages
    nxt = [0] * stages
    slots: list[Slot] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(stages):
            if nxt[s] == len(orders[s]):
                continue
            kind, k, i = orders[s][nxt[s]]
            if kind == "F":
                dep = done.get(("F", k - 1, i)) if k else 0.0
            else:
                dep = done.get(("B", k + 1, i)) if k < chunks - 1 else done.get(("F", k, i))
            if dep is None:
                continue
            start = max(free[s], dep)
            end = start + (f if kind == "F" else b)
            done[(kind, k, i)] = end
            free[s] = end
            slots.append(Slot(s, i, kind, start, end, chunk=k // stages))
            nxt[s] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise ValueError(f"schedule {schedule!r} deadlocks with {stages} stages and "
                             f"{microbatches} micro-batches")
    return slots


def plan_schedule(plan: Plan) -> tuple[list[Slot], int]:
    """The plan's step as slots (micro-batches capped at MAX_DRAWN_MICROBATCHES) and the
    number of micro-batches it really has."""
    s, b = plan.strategy, plan.predicted.breakdown
    m = s.num_microbatches
    per_microbatch = (b.compute_s + b.communication_s + b.recompute_s) / max(1, m)
    drawn = min(m, MAX_DRAWN_MICROBATCHES)
    v = s.virtual_stages if s.schedule == "interleaved" else 1
    if v > 1 and drawn < m:  # whole groups of pp micro-batches, as the order takes them
        drawn = max(s.pp, drawn - drawn % s.pp)
    return schedule_slots(s.pp, drawn, s.schedule, per_microbatch / 3,
                          2 * per_microbatch / 3, virtual_stages=v), m


def memory_bars(plan: Plan) -> list[tuple[str, int]]:
    """(label, peak bytes per device) per pipeline stage (the largest over the stage's
    devices, ``reports.device_groups``): a bar per stage, never per device."""
    from tfplan.reports.device_groups import stage_groups
    return [(f"stage {g.stage}", g.peak_memory_bytes) for g in stage_groups(plan)]


def memory_scale(capacity: float, largest: float) -> tuple[float, bool, str]:
    """``(top, capacity_on_scale, caption)`` of a memory chart: a linear byte axis from 0
    to ``top``. The capacity line is drawn when the capacity is at most four times the
    largest bar; else the axis ends just above the largest bar, so that a 15 MiB model on
    a 5.89 GiB device still draws visible bars, and the caption names the scale, how far
    off it the capacity is and the headroom left (the dashboard says the same)."""
    largest = max(largest, 1.0)
    on_scale = capacity <= 4 * largest
    top = 1.1 * max(largest, capacity if on_scale else 0.0)
    free = capacity - largest
    room = (f"headroom {_gib(free)} ({100 * free / capacity:.1f}% free)" if free >= 0
            else f"the fullest stage is {_gib(-free)} over")
    if on_scale:
        return top, True, (f"linear axis from 0; capacity {_gib(capacity)} (red line); "
                           f"{room}" + (" on the fullest stage" if free >= 0 else ""))
    return top, False, (f"linear axis 0 to {_gib(top)} (zoomed to the bars); capacity "
                        f"{_gib(capacity)} = {capacity / largest:,.0f}x the fullest stage, "
                        f"off scale; {room}")


def layer_positions(profile: ModelProfile) -> dict[str, tuple[int, int]]:
    """(column, row) of each layer: column = longest path from the model's inputs,
    row = order within the column. A block's entries feed each other both ways (its own
    code reads and feeds its sub-layers): an input listed later in the order is skipped."""
    depth: dict[str, int] = {}
    for l in profile.layers:  # topological order, but inside blocks
        depth[l.name] = 1 + max((depth[i] for i in l.inputs if i in depth), default=-1)
    rows: dict[int, int] = {}
    out = {}
    for l in profile.layers:
        c = depth[l.name]
        out[l.name] = (c, rows.get(c, 0))
        rows[c] = rows.get(c, 0) + 1
    return out


# --- drawing ---------------------------------------------------------------------------------

def _short(device: str) -> str:
    return device.replace("/job:worker/task:", "w").replace("/device:", "")


def _canvas(width: int, height: int):
    from PIL import Image, ImageDraw
    image = Image.new("RGB", (width, height), BACKGROUND)
    return image, ImageDraw.Draw(image)


def _shade(color: tuple[int, int, int], k: float) -> tuple[int, int, int]:
    return tuple(int(c + (255 - c) * k) for c in color)


def _time(t: float) -> str:
    if t == 0:
        return "0"
    return f"{t:.2f} s" if t >= 1 else f"{t * 1e3:.1f} ms" if t >= 1e-3 else f"{t * 1e6:.0f} us"


KIND_COLORS = {"F": PALETTE[0], "B": PALETTE[1], "R": PALETTE[2]}  # forward, backward, recompute


def recompute_share(plan: Plan) -> float:
    """The share of each simulated backward slot (2/3 of a micro-batch's compute +
    communication + recompute time, ``plan_schedule``) that recomputes the forward."""
    b = plan.predicted.breakdown
    total = b.compute_s + b.communication_s + b.recompute_s
    return min(1.0, 1.5 * b.recompute_s / total) if total > 0 else 0.0


def timeline_image(plan: Plan, width: int = 1200) -> np.ndarray:
    """Stages x time: passes coloured by kind -- forward, backward and (when the plan
    recomputes) the recomputed forward at the start of each backward -- never by
    micro-batch, each labelled with its micro-batch number (``i.c``: model chunk c of an
    interleaved schedule, whose odd chunks also carry a dark band); idle time grey, a time
    axis below and a legend; the title says the schedule and the bubble share."""
    slots, m = plan_schedule(plan)
    pp = plan.strategy.pp
    left, top, row_h, right = 100, 44, 30, 20
    rows_h = pp * row_h
    image, draw = _canvas(width, top + rows_h + 60)
    small, big = _font(15), _font(18)
    end = max(sl.end_s for sl in slots) or 1.0
    scale = (width - left - right) / end
    busy = sum(sl.end_s - sl.start_s for sl in slots)
    share = recompute_share(plan)
    v = plan.strategy.virtual_stages if plan.strategy.schedule == "interleaved" else 1
    title = (f"{plan.strategy.schedule} pp={pp}" + (f" v={v}" if v > 1 else "") + f" m={m}" + (
        f" (first {1 + max(sl.microbatch for sl in slots)} drawn)"
        if m > MAX_DRAWN_MICROBATCHES else "")
        + f": bubble {100 * (1 - busy / (pp * end)):.0f}% of the pipeline time")
    draw.text((left, 10), title, fill=TEXT, font=big)
    for s in range(pp):
        y = top + s * row_h
        draw.rectangle((left, y, width - right, y + row_h - 4), fill=IDLE)
        if row_h >= 16:
            draw.text((6, y + 5), f"stage {s}", fill=TEXT, font=small)
    for sl in slots:
        y = top + sl.stage * row_h
        x0, x1 = left + sl.start_s * scale, left + sl.end_s * scale
        x1 = max(x0 + 1, x1 - 1)
        draw.rectangle((x0, y, x1, y + row_h - 4), fill=KIND_COLORS[sl.kind])
        if sl.kind == "B" and share > 0:
            draw.rectangle((x0, y, max(x0 + 1, x0 + (x1 - x0) * share), y + row_h - 4),
                           fill=KIND_COLORS["R"])
        if v > 1 and sl.chunk % 2:
            draw.rectangle((x0, y, x1, y + 4), fill=TEXT)
        label = f"{sl.microbatch}" + (f".{sl.chunk}" if v > 1 else "")
        if x1 - x0 > 9 * len(label) + 4:
            draw.text((x0 + 3, y + 6), label, fill=TEXT, font=small)
    axis_y = top + rows_h + 2
    draw.line((left, axis_y, width - right, axis_y), fill=TEXT)
    for t in axis_ticks(end):  # the time axis
        x = left + (width - left - right) * t / end
        draw.line((x, axis_y, x, axis_y + 5), fill=TEXT)
        draw.text((min(x, width - right - 70), axis_y + 7), _time(t), fill=TEXT, font=small)
    legend_y, x = axis_y + 32, left
    keys = [(KIND_COLORS["F"], "forward"), (KIND_COLORS["B"], "backward")]
    if share > 0:
        keys.append((KIND_COLORS["R"], "recompute"))
    keys.append((IDLE, "idle (bubble)"))
    for color, text in keys:
        draw.rectangle((x, legend_y, x + 18, legend_y + 14), fill=color)
        draw.text((x + 24, legend_y - 2), text, fill=TEXT, font=small)
        x += 24 + 9 * len(text) + 24
    draw.text((x, legend_y - 2), "number = micro-batch" + (
        ".chunk (odd chunks: dark top band)" if v > 1 else ""), fill=TEXT, font=small)
    return np.asarray(image)


def _font(size: int):
    from PIL import ImageFont
    return ImageFont.load_default(size=size)


def axis_ticks(top: float, unit: float = 1.0) -> list[float]:
    """About five round ticks from 0 to ``top``: steps of 1, 2 or 5 times a power of ten
    of ``unit`` (bytes: a GiB or a MiB, so the labels read 10 GiB, 20 GiB, ...)."""
    import math
    raw = top / unit / 5 or 1.0
    power = 10 ** math.floor(math.log10(raw))
    step = next(m for m in (1, 2, 5, 10) if m * power >= raw) * power * unit
    return [k * step for k in range(int(top / step * (1 + 1e-9)) + 1)]


def _byte_unit(top: float) -> float:
    return 2.0**30 if top >= 2**30 else 2.0**20 if top >= 2**20 else 1.0


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def memory_image(plan: Plan, width: int = 1200, height: int = 480) -> np.ndarray:
    """Predicted peak memory per device of each pipeline stage (bars, values on them)
    on a byte axis, against the device capacity (red line; named in the caption and left
    off the axis when it is more than four times the largest bar, so small models do not
    draw an empty box; ``memory_scale``)."""
    bars = memory_bars(plan)
    capacity = plan.predicted.memory_capacity_bytes
    largest = max([n for _, n in bars] + [1])
    top_value, show_capacity, caption = memory_scale(capacity, largest)
    left, right, bottom, top = 110, 20, 50, 64
    image, draw = _canvas(width, height)
    small, big = _font(16), _font(20)
    draw.text((left, 8), "peak memory per device, per pipeline stage", fill=TEXT, font=big)
    draw.text((10, 36), caption, fill=TEXT, font=_font(15))
    plot_h, plot_w = height - top - bottom, width - left - right
    for v in axis_ticks(top_value, _byte_unit(top_value)):  # the axis: round values
        y = top + plot_h - plot_h * v / top_value
        draw.line((left, y, width - right, y), fill=GRID)
        unit = _byte_unit(top_value)
        draw.text((6, y - 9), f"{v / unit:g} " + {2**30: "GiB", 2**20: "MiB"}.get(unit, "B"),
                  fill=TEXT, font=small)
    draw.line((left, top, left, top + plot_h), fill=TEXT)
    step = plot_w / max(1, len(bars))
    every = max(1, int(-(-70 // step)))  # label every n-th bar where they would overlap
    for k, (label, nbytes) in enumerate(bars):
        h = plot_h * nbytes / top_value
        x0 = left + k * step + 2
        color = PALETTE[0] if nbytes <= capacity else PALETTE[3]
        draw.rectangle((x0, top + plot_h - h, x0 + max(2, step - 4), top + plot_h), fill=color)
        if k % every == 0:
            draw.text((x0, top + plot_h + 6), label if step >= 70 else label.split()[-1],
                      fill=TEXT, font=small)
            if step >= 70:
                draw.text((x0, max(top, top + plot_h - h - 20)), _gib(nbytes), fill=TEXT,
                          font=small)
        if 34 <= step < 70:  # narrower bars: the value in the axis' unit
            unit = _byte_unit(top_value)
            draw.text((x0, max(top, top + plot_h - h - 16)), f"{nbytes / unit:.1f}",
                      fill=TEXT, font=_font(13))
    if step < 70:
        draw.text((width - right - 110, height - 22), "pipeline stage", fill=TEXT, font=small)
    if show_capacity:
        y = top + plot_h - plot_h * capacity / top_value
        draw.line((left, y, width - right, y), fill=PALETTE[3], width=2)
    return np.asarray(image)


def graph_image(profile: ModelProfile, plan: Plan, width: int = 1200) -> np.ndarray:
    """The layer graph (at most 80 layers; else one coloured strip per layer, with a
    stage key), each layer coloured by the stage that holds it."""
    stage_of = {name: k % plan.strategy.pp for k, st in enumerate(plan.stages)
                for name in st.layers}
    small, big = _font(14), _font(18)
    if len(profile.layers) > 80:
        image, draw = _canvas(width, 120)
        draw.text((10, 8), f"{len(profile.layers)} layers in topological order, coloured by "
                           f"stage ({plan.strategy.pp} stages)", fill=TEXT, font=big)
        w = (width - 20) / len(profile.layers)
        for i, l in enumerate(profile.layers):
            color = PALETTE[stage_of.get(l.name, 0) % len(PALETTE)]
            draw.rectangle((10 + i * w, 40, 10 + (i + 1) * w, 76), fill=color)
        for k in range(min(plan.strategy.pp, len(PALETTE))):  # the key
            draw.rectangle((10 + k * 118, 90, 26 + k * 118, 104), fill=PALETTE[k])
            draw.text((32 + k * 118, 88), f"stage {k}" + (
                f"+{len(PALETTE)}n" if plan.strategy.pp > len(PALETTE) else ""),
                fill=TEXT, font=small)
        return np.asarray(image)
    pos = layer_positions(profile)
    columns = 1 + max(c for c, _ in pos.values())
    rows = 1 + max(r for _, r in pos.values())
    box_w, box_h, gap_x, gap_y = 140, 30, 16, 14
    per_band = max(1, int((width - 20) // (box_w + gap_x)))  # long graphs wrap into bands
    bands = -(-columns // per_band)
    band_h = rows * (box_h + gap_y) + 16
    image, draw = _canvas(width, 44 + bands * band_h)
    draw.text((10, 8), f"layer graph, coloured by stage ({plan.strategy.pp} stages)", fill=TEXT,
              font=big)

    def xy(name: str) -> tuple[float, float]:
        c, r = pos[name]
        band, c = divmod(c, per_band)
        return 10 + c * (box_w + gap_x), 38 + band * band_h + r * (box_h + gap_y)

    for l in profile.layers:
        for src in l.inputs:
            if src in pos:
                (x0, y0), (x1, y1) = xy(src), xy(l.name)
                draw.line((x0 + box_w, y0 + box_h / 2, x1, y1 + box_h / 2), fill=GRID, width=2)
    for l in profile.layers:
        x, y = xy(l.name)
        color = PALETTE[stage_of.get(l.name, 0) % len(PALETTE)]
        draw.rectangle((x, y, x + box_w, y + box_h), fill=_shade(color, 0.35))
        draw.text((x + 4, y + 7), l.name[:16], fill=TEXT, font=small)
    return np.asarray(image)


def plan_images(profile: ModelProfile, plan: Plan) -> dict[str, np.ndarray]:
    """Tag -> RGB image for ``reports.tensorboard.write_analysis``."""
    return {"plan/pipeline_schedule": timeline_image(plan),
            "plan/memory_per_stage": memory_image(plan),
            "plan/layer_graph": graph_image(profile, plan)}
