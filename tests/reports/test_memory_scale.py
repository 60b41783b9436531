"""Memory charts where the model is orders of magnitude smaller than the device (issue
16, "Readable pictures"): the axis zooms to the bars, so they are visible, and the chart
names its scale, where the capacity is and the headroom -- in the PNG (reports.images)
and on the dashboard (headless Chromium)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from tfplan.core.presets import parse_cluster
from tfplan.planner.search import search
from tfplan.reports.images import PALETTE, _font, memory_image, memory_scale
from tfplan.reports.plugin import PLUGIN_NAME
from tfplan.reports.tensorboard import write_analysis
from tests.planner.gpt_profile import gpt_profile
from tests.reports.test_plugin import _dump_dom, _serve

GiB, MiB = 2**30, 2**20


def test_a_small_model_on_a_big_device_zooms_to_the_bars_and_says_so():
    top, on_scale, caption = memory_scale(5.89 * GiB, 15 * MiB)
    assert not on_scale and top == pytest.approx(1.1 * 15 * MiB)
    assert caption.startswith("linear axis 0 to 16.5 MiB (zoomed to the bars)")
    assert "capacity 5.89 GiB = 402x the fullest stage, off scale" in caption
    assert "headroom 5.88 GiB (99.8% free)" in caption


@pytest.mark.parametrize("largest,words", [
    (60 * GiB, "headroom 20.00 GiB (25.0% free) on the fullest stage"),
    (90 * GiB, "the fullest stage is 10.00 GiB over")])
def test_a_capacity_near_the_bars_is_drawn_as_a_line(largest, words):
    top, on_scale, caption = memory_scale(80 * GiB, largest)
    assert on_scale and top == pytest.approx(1.1 * max(80 * GiB, largest))
    assert caption.startswith("linear axis from 0; capacity 80.00 GiB (red line); ")
    assert caption.endswith(words)


@pytest.fixture(scope="module")
def small_plan():
    profile = gpt_profile(2, 64, 2, vocab=256, seq=32)
    plan = search(profile, parse_cluster("8xA100-80GB"), 8).chosen
    assert plan.predicted.max_memory_bytes * 1000 < plan.predicted.memory_capacity_bytes
    return profile, plan


def test_the_png_draws_visible_bars_and_a_caption_that_fits(small_plan):
    from PIL import Image, ImageDraw
    _, plan = small_plan
    image = memory_image(plan)
    bar = np.all(image == np.array(PALETTE[0], dtype=np.uint8), axis=2)
    rows = np.where(bar.any(axis=1))[0]
    assert rows.size and rows.max() - rows.min() > 0.6 * (480 - 64 - 50)  # a tall bar
    caption = memory_scale(plan.predicted.memory_capacity_bytes,
                           plan.predicted.max_memory_bytes)[2]
    width = ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength(caption, font=_font(15))
    assert width <= 1200 - 20


def test_the_dashboard_names_the_scale_and_the_headroom(small_plan, tmp_path_factory,
                                                        tmp_path):
    profile, plan = small_plan
    root = tmp_path_factory.mktemp("small")
    write_analysis(root / "small", profile, plan, [plan])
    server = _serve(root)
    base = next(server)
    try:
        dom = _dump_dom(base + f"/data/plugin_entry.html?name={PLUGIN_NAME}", tmp_path)
    finally:
        server.close()
    scale = re.search(r'<p class="memory-scale"[^>]*>([^<]*)</p>', dom).group(1)
    assert scale.startswith("Linear axis from 0 to ") and "zoomed to the bars" in scale
    assert "off this scale; headroom " in scale and "% free)." in scale
    box = dom[dom.index('class="memory-box"'):]
    box = box[:box.index("</svg>")]
    heights = [float(h) for h in re.findall(r'<rect [^>]*height="([0-9.]+)"', box)]
    assert max(heights) > 0.6 * 240  # the bar fills most of the chart
