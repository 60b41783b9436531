"""``plan report DIR``: what ``plan analyze --out DIR`` found, again, in the terminal or as
one self-contained HTML file.

Pipeline position: reads the files ``plan analyze`` wrote -- ``DIR/plan.json`` (the
chosen plan), ``DIR/profile.json`` (the model profile) and ``DIR/candidates.json``
(the ranked candidates), checked against ``DIR/manifest.json`` to be one run of one
model (``reports.analysis_dir``) -- and
renders the same tables the terminal and TensorBoard show (``reports.tables``) and
the same pictures (``reports.images``, embedded as PNG data URIs, so the HTML file
needs nothing else: no network, no scripts).
"""
from __future__ import annotations

import base64
import html
import io
import os
from typing import Any

from tfplan.reports.analysis_dir import Analysis, read_analysis_dir, save_candidates  # noqa: F401
from tfplan.reports.images import plan_images
from tfplan.reports.device_groups import device_ranges, stage_groups
from tfplan.reports.layer_table import layer_table
from tfplan.reports.tables import (CANDIDATE_HEADER, PROFILE_HEADER, candidate_rows, fmt_bytes,
                            fmt_fraction, fmt_seconds, fmt_tflops, mfu, profile_rows)


def load_analysis(out_dir: str | os.PathLike) -> Analysis:
    """The analysis ``plan analyze --out out_dir`` wrote, checked to be one complete run
    of one model (``reports.analysis_dir``); PlannerError naming what is missing, and
    IncompleteAnalysisError naming a truncated or mixed file, with the command to re-run."""
    return read_analysis_dir(out_dir)


def summary_lines(a: Analysis) -> list[str]:
    """The chosen plan in a few plain sentences."""
    p, s = a.chosen.predicted, a.chosen.strategy
    return [
        f"Model {a.profile.model_name}: {a.profile.params:,} params; cluster "
        f"{a.chosen.cluster.name}; global batch {a.chosen.global_batch}.",
        f"Chosen: {a.chosen.name} ({s.describe()}).",
        f"Predicted step time {fmt_seconds(p.step_time_s)}, {p.samples_per_s:,.1f} samples/s, "
        f"{fmt_tflops(p.model_tflops_per_device)} model TFLOP/s per device (MFU "
        f"{fmt_fraction(mfu(a.chosen))}), peak memory {fmt_bytes(p.max_memory_bytes)} of {fmt_bytes(p.memory_capacity_bytes)} "
        f"per device{'' if p.fits else ' (does NOT fit)'}.",
    ] + ([f"Why: {a.chosen.reason}"] if a.chosen.reason else [])


STAGE_HEADER = ("stage", "devices", "where", "layers", "peak memory / device")


def stage_rows(a: Analysis) -> list[tuple[str, ...]]:
    """One row per pipeline stage, its devices as ranges (``reports.device_groups``)."""
    return [(str(g.stage), f"{len(g.devices):,}", g.where, str(g.layers),
             fmt_bytes(g.peak_memory_bytes)) for g in stage_groups(a.chosen)]


TRAFFIC_HEADER = ("devices", "count", "tp", "pp", "dp", "zero", "cp", "ep", "total / device")


def traffic_rows(plan: Any) -> list[tuple[str, ...]]:
    """The bytes each device sends per step by kind (``Prediction.sent_bytes_per_device``,
    priced by ``planner.traffic``), one row per set of devices sending the same, busiest
    first: readable at thousands of devices. [] for a plan that does not list them."""
    from tfplan.planner.traffic import KINDS

    same: dict[tuple[int, ...], list[str]] = {}
    for device, kinds in plan.predicted.sent_bytes_per_device:
        row = dict(kinds)
        same.setdefault(tuple(int(row.get(k, 0)) for k in KINDS), []).append(device)
    out = []
    for sent, devices in sorted(same.items(), key=lambda kv: -sum(kv[0])):
        cells = {k: (fmt_bytes(v) if v else "-") for k, v in zip(KINDS, sent)}
        out.append((device_ranges(plan, devices), f"{len(devices):,}",
                    *(cells[k] for k in TRAFFIC_HEADER[2:-1]), fmt_bytes(sum(sent))))
    return out


PLANNED_HEADER = ("layer", "type", "split", "time / micro-batch", "state", "activations",
                  "memory / device")
PLANNED_TOP = 10  # layers per stage in the HTML report (the dashboard filters and sorts)


def planned_layer_sections(a: Analysis, top: int = PLANNED_TOP
                           ) -> list[tuple[str, list[tuple[str, ...]]]]:
    """Per pipeline stage of the chosen plan: a title and the rows of its ``top`` layers by
    memory on one device as planned (``reports.layer_table``), then the stage's other rows
    (ZeRO buffers, recomputation, margin) and its total, the stage's predicted peak."""
    t = layer_table(a.profile, a.chosen)
    rows = [dict(zip(t["fields"], r)) for r in t["rows"]]
    out = []
    for g in t["stages"]:
        mine = sorted((r for r in rows if r["stage"] == g["stage"]),
                      key=lambda r: -r["memory_bytes"])
        body = [(r["name"], r["type"], "tp" if r["split"] else "", fmt_seconds(r["time_s"]),
                 fmt_bytes(r["state_bytes"]), fmt_bytes(r["activation_bytes"]),
                 fmt_bytes(r["memory_bytes"])) for r in mine[:top]]
        body.append((f"all {len(mine)} layers", "", "", "", "", "",
                     fmt_bytes(g["layers_bytes"])))
        body += [(x["label"], "", "", "", "", "", fmt_bytes(x["bytes"])) for x in g["rows"]]
        body.append(("stage total (peak per device)", "", "", "", "", "",
                     fmt_bytes(g["total_bytes"])))
        out.append((f"Stage {g['stage']}: top {min(top, len(mine))} of {len(mine)} layers by "
                    "memory per device", body))
    return out


def _table(header, rows) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _png_data_uri(image) -> str:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def html_report(a: Analysis) -> str:
    """One self-contained HTML page: summary, candidates, pictures, the layers per stage as
    planned, per-layer profile."""
    images = "".join(
        f'<figure><img alt="{html.escape(tag)}" src="{_png_data_uri(image)}">'
        f"<figcaption>{html.escape(tag)}</figcaption></figure>"
        for tag, image in plan_images(a.profile, a.chosen).items())
    title = f"Parallel plan: {a.profile.model_name} on {a.chosen.cluster.name}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; color: #212121; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 13px; }}
th, td {{ border: 1px solid #ddd; padding: 3px 8px; text-align: right; }}
th {{ background: #f5f5f5; }} td:nth-child(-n+3) {{ text-align: left; }}
img {{ max-width: 100%; border: 1px solid #eee; }} figure {{ margin: 1em 0; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
{"".join(f"<p>{html.escape(line)}</p>" for line in summary_lines(a))}
<h2>Candidates (ranked by predicted step time; * = chosen)</h2>
{_table(CANDIDATE_HEADER, candidate_rows(a.candidates, a.chosen))}
<h2>The chosen plan</h2>
{_table(STAGE_HEADER, stage_rows(a))}
{images}
<h2>Layers per stage, as planned (split by tp, sharded by ZeRO, recomputed or not)</h2>
{"".join(f"<h3>{html.escape(title)}</h3>" + _table(PLANNED_HEADER, rows)
         for title, rows in planned_layer_sections(a))}
<h2>Per-layer profile (batch {a.profile.batch_size})</h2>
{_table(PROFILE_HEADER, profile_rows(a.profile))}
</body></html>
"""
