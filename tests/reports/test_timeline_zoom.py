"""The timeline's zoom buttons and slider, clicked in headless Chromium: the dashboard's
script (reports/static/index.js) served with a run's analysis by a plain local HTTP
server, a page that renders it, clicks, and writes what it saw into the DOM."""
from __future__ import annotations

import functools
import http.server
import json
import re
import shutil
import threading

import pytest

from tfplan.core.presets import parse_cluster
from tfplan.planner.search import search
from tfplan.reports.plugin import STATIC
from tfplan.reports.tensorboard import plugin_analysis
from tests.planner.gpt_profile import gpt_profile
from tests.reports.test_plugin import _dump_dom

PAGE = """<!doctype html><html><body><script type="module">
import {render} from './index.js';
await render();
const zoom = () => document.querySelector('svg.timeline').getAttribute('data-zoom');
const seen = [zoom()];
document.querySelector('.timeline-zoom-in').click(); seen.push(zoom());
document.querySelector('.timeline-zoom-in').click(); seen.push(zoom());
document.querySelector('.timeline-zoom-out').click(); seen.push(zoom());
const slider = document.querySelector('.timeline-zoom');
slider.value = '0'; slider.dispatchEvent(new Event('input')); seen.push(zoom());
const box = document.querySelector('.timeline-scroll');
const wide = document.querySelector('svg.timeline').getAttribute('width');
document.querySelector('.timeline-zoom-in').click();
document.querySelector('.timeline-zoom-in').click();
document.body.setAttribute('data-seen', seen.join(','));
document.body.setAttribute('data-scroll', [box.scrollWidth > box.clientWidth,
    box.getBoundingClientRect().width <= 982, wide].join(','));
</script></body></html>"""


def test_zoom_buttons_and_slider_widen_the_timeline_inside_its_box(tmp_path):
    profile = gpt_profile(4, 512, 8, vocab=4096, seq=256)
    plan = search(profile, parse_cluster("8xA100-80GB"), 16,
                  fix={"pp": 4, "microbatch_size": 1, "schedule": "1f1b"}).chosen
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(f"{STATIC}/index.js", site / "index.js")
    (site / "runs").write_text(json.dumps({"runs": [{"run": "p", "model": "m",
                                                     "plan": plan.name, "cluster": "c"}],
                                           "unreadable": []}))
    (site / "analysis").write_text(json.dumps(plugin_analysis(profile, plan, [plan])))
    (site / "page.html").write_text(PAGE)

    class Handler(http.server.SimpleHTTPRequestHandler):
        extensions_map = {".js": "text/javascript", ".html": "text/html", "": "application/json"}

        def log_message(self, *args):
            pass

        def translate_path(self, path):  # ./analysis?run=p -> the file "analysis"
            return super().translate_path(path.split("?")[0])

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        dom = _dump_dom(f"http://127.0.0.1:{server.server_address[1]}/page.html", tmp_path)
    finally:
        server.shutdown()
    seen = re.search(r'data-seen="([^"]*)"', dom)
    assert seen, dom[-2000:]
    first = int(seen.group(1).split(",")[0])
    steps = [int(z) for z in seen.group(1).split(",")]
    assert steps == [first, 2 * first, 4 * first, 2 * first, 1]  # +, +, -, slider to 1x
    overflow, box_fits, width_at_1x = re.search(r'data-scroll="([^"]*)"', dom).group(1).split(",")
    # zoomed, the chart is wider than its box, which scrolls; the box keeps its width
    assert overflow == "true" and box_fits == "true"
    assert int(width_at_1x) <= 980
