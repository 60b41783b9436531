"""The pipeline timeline (issue 16, "Readable pictures"): passes coloured by kind
(forward, backward, recompute), never by micro-batch; each pass labelled with its
micro-batch (and model chunk, interleaved); zoom that scrolls inside the chart. The PNG
(reports.images) read as pixels; the dashboard rendered by headless Chromium."""
from __future__ import annotations

import re

import numpy as np
import pytest

from tfplan.core.presets import parse_cluster
from tfplan.planner.search import search
from tfplan.reports.images import KIND_COLORS, PALETTE, recompute_share, timeline_image
from tfplan.reports.plugin import PLUGIN_NAME
from tfplan.reports.tensorboard import write_analysis
from tests.planner.gpt_profile import gpt_profile
from tests.reports.test_plugin import _dump_dom, _serve

PROFILE = gpt_profile(4, 512, 8, vocab=4096, seq=256)
FIXES = {  # 16 and 32 micro-batches: more than the 10 colours that used to repeat
    "onef1b": {"pp": 4, "microbatch_size": 1, "schedule": "1f1b"},
    "interleaved": {"pp": 2, "microbatch_size": 1, "schedule": "interleaved",
                    "virtual_stages": 2, "recompute": "full"},
}


@pytest.fixture(scope="module")
def plans():
    cluster = parse_cluster("8xA100-80GB")
    return {run: search(PROFILE, cluster, 16 if run == "onef1b" else 32, fix=fix).chosen
            for run, fix in FIXES.items()}


def _colours(image):
    return {tuple(int(c) for c in px) for px in image.reshape(-1, 3)}


@pytest.mark.parametrize("run", list(FIXES))
def test_the_image_colours_passes_by_kind_not_by_micro_batch(plans, run):
    plan = plans[run]
    assert plan.strategy.num_microbatches > 10
    colours = _colours(timeline_image(plan))
    assert KIND_COLORS["F"] in colours and KIND_COLORS["B"] in colours
    assert (KIND_COLORS["R"] in colours) == (plan.strategy.recompute != "none")
    assert (recompute_share(plan) > 0) == (plan.strategy.recompute != "none")
    for unused in PALETTE[3:]:  # the per-micro-batch colours are gone
        assert unused not in colours


def test_the_dashboard_timeline_has_kinds_labels_and_zoom(plans, tmp_path_factory, tmp_path):
    root = tmp_path_factory.mktemp("timeline")
    for run, plan in plans.items():
        from tfplan.planner.search import search as _s  # noqa: F401  (plans are searched)
        write_analysis(root / run, PROFILE, plan, [plan])
    server = _serve(root)
    base = next(server)
    try:
        dom = _dump_dom(base + f"/data/plugin_entry.html?name={PLUGIN_NAME}", tmp_path)
    finally:
        server.close()
    # the first run (interleaved, recomputing) is drawn
    box = dom[dom.index('class="timeline-box"'):]
    box = box[:box.index("</svg>")]
    fills = set(re.findall(r'<rect [^>]*fill="(#[0-9a-f]+)"', box))
    assert {"#4285f4", "#34a853", "#fbbc05"} <= fills  # forward, backward, recompute
    assert fills <= {"#4285f4", "#34a853", "#fbbc05", "#eee", "#212121"}, fills
    labels = re.findall(r'class="slot-label"[^>]*>([0-9.]+)<', box)
    assert {"0.0", "0.1"} <= set(labels), labels  # micro-batch.model chunk
    for part in ("timeline-zoom-in", "timeline-zoom-out", 'type="range"', "overflow-x:auto",
                 ">forward<", ">backward<", ">recompute",
                 "number = micro-batch.model chunk"):
        assert part in box, part
    # 32 micro-batches in 2 chunks: zoomed in (8x) so that every pass has its label, the
    # chart wider than its box, which scrolls (the page does not)
    assert 'data-zoom="8"' in box and ">8x<" in box
    assert {"0.0", "0.1", "31.0", "31.1"} <= set(labels)
    width = int(re.search(r'<svg [^>]*width="(\d+)"[^>]*class="timeline"', box).group(1))
    assert width > 5000
