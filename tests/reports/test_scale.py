"""Reports at the sizes the tool exists for (issue 16): a 175B GPT (96 layers,
hidden 12288) on 192 nodes x 8 A100s, 1,536 devices. Every report groups the devices by
the plan's structure (``reports.device_groups``), never lists them: the TensorBoard run
has a bounded number of scalar tags, its text summaries name device ranges, the
dashboard's analysis.json stays under 1 MB, and the dashboard, rendered by headless
Chromium from the plugin's own routes, fits a 1600 px window and draws the
dp x tp x pp mesh."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading

import pytest

from tfplan.core.presets import parse_cluster
from tfplan.planner.search import search
from tfplan.reports.device_groups import MAX_MESH_COLUMNS, device_ranges, stage_groups
from tfplan.reports.plugin import ParallelPlanPlugin, analysis_path
from tfplan.reports.tensorboard import write_analysis
from tests.planner.gpt_profile import gpt_profile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEVICES = 1536
WINDOW = 1600


@pytest.fixture(scope="module")
def big():
    """The searched plan for 1,536 A100s (a few seconds: the candidates of the whole
    search, as ``plan analyze`` writes them) and its TensorBoard run."""
    profile = gpt_profile(96, 12288, 96, seq=2048)
    result = search(profile, parse_cluster("192x8xA100-80GB"), DEVICES)
    assert len(result.chosen.devices) == DEVICES and len(result.candidates) > 20
    return profile, result


@pytest.fixture(scope="module")
def logdir(big, tmp_path_factory):
    profile, result = big
    root = tmp_path_factory.mktemp("scale")
    write_analysis(root / "gpt145b", profile, result.chosen, result.candidates)
    # an analysis.json as plan analyze wrote it before issue 16: the plans whole
    tiny = gpt_profile(2, 256, 4, vocab=1024, seq=64)
    small = search(tiny, parse_cluster("8xA100-80GB"), 8, fix={"pp": 2})
    write_analysis(root / "old", tiny, small.chosen, small.candidates)
    path = analysis_path(str(root / "old"))
    doc = json.loads(open(path, encoding="utf-8").read())
    doc["plan"] = small.chosen.to_dict()
    doc["candidates"] = [c.to_dict() for c in small.candidates]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    return root


def _accumulator(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0, "images": 0})
    acc.Reload()
    return acc


def _text(acc, tag: str) -> str:
    import tensorflow as tf
    return tf.make_ndarray(acc.Tensors(tag)[0].tensor_proto).item().decode()


def test_the_run_has_a_bounded_number_of_scalar_tags(big, logdir):
    acc = _accumulator(logdir / "gpt145b")
    tensors = acc.Tags()["tensors"]
    scalars = [t for t in tensors if t.startswith(("predicted/", "candidates/"))]
    print(f"{len(scalars)} scalar tags for {DEVICES} devices: {sorted(scalars)}")
    assert len(scalars) <= 50
    assert not [t for t in tensors if "device_" in t]
    chosen = big[1].chosen
    per_stage = acc.Tensors("predicted/peak_memory_bytes_per_stage")
    assert [e.step for e in per_stage] == list(range(chosen.strategy.pp))


def test_text_summaries_name_device_ranges_not_devices(big, logdir):
    chosen = big[1].chosen
    acc = _accumulator(logdir / "gpt145b")
    text = _text(acc, "plan/chosen")
    print(f"plan/chosen: {len(text):,} characters")
    assert len(text) < 8_000  # one row per pipeline stage
    assert chosen.name in text and f"{DEVICES:,} devices" in text
    assert re.search(r"GPU:0\.\.7 on nodes \d+\.\.\d+", text)
    assert "/job:worker" not in text  # no device is named one by one
    for tag in ("plan/candidates", "profile/layers"):
        assert "/job:worker" not in _text(acc, tag)


def test_analysis_json_does_not_grow_with_the_devices(big, logdir):
    chosen = big[1].chosen
    path = analysis_path(str(logdir / "gpt145b"))
    size = os.path.getsize(path)
    print(f"analysis.json: {size:,} bytes for {DEVICES} devices")
    assert size < 1_000_000
    doc = json.loads(open(path, encoding="utf-8").read())
    assert len(doc["plan"]["stages"]) == chosen.strategy.pp
    assert "peak_memory_bytes_per_device" not in json.dumps(doc)
    mesh = doc["plan"]["mesh"]
    assert (mesh["dp"], mesh["tp"], mesh["pp"]) == (chosen.strategy.dp, chosen.strategy.tp,
                                                    chosen.strategy.pp)
    assert mesh["dp"] * mesh["tp"] * mesh["pp"] == mesh["devices"] == DEVICES
    assert len(mesh["rows"]) == chosen.strategy.pp
    assert all(len(r["cells"]) == len(mesh["columns"]) <= MAX_MESH_COLUMNS
               for r in mesh["rows"])


def test_the_html_report_names_ranges_per_stage(big):
    from tfplan.reports.analysis_dir import Analysis
    from tfplan.reports.report import html_report, summary_lines
    profile, result = big
    a = Analysis(profile, result.chosen, result.candidates)
    page = html_report(a)
    assert "/job:worker" not in page
    assert re.search(r"<td>GPU:0\.\.7 on nodes \d+\.\.\d+</td>", page)
    assert page.count("<td>GPU:0..7 on nodes") == result.chosen.strategy.pp
    assert "MFU" in summary_lines(a)[2]


def test_device_ranges_of_a_small_and_an_uneven_set():
    plan = search(gpt_profile(2, 256, 4, vocab=1024, seq=64), parse_cluster("4x8xA100-80GB"),
                  32, fix={"dp": 4, "tp": 2, "pp": 4}).chosen
    groups = stage_groups(plan)
    assert [g.where for g in groups] == [device_ranges(plan, g.devices) for g in groups]
    names = plan.cluster.device_names()
    assert device_ranges(plan, names[:16]) == "GPU:0..7 on nodes 0..1"
    assert device_ranges(plan, names[0:2] + names[8:10] + names[20:21]) == (
        "GPU:0..1 on nodes 0..1; GPU:4 on node 2")


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


# The dashboard (reports/static/index.js) as the plugin serves it, on a page that
# measures it once drawn: the document's width against the window's.
HARNESS = """<!DOCTYPE html><html><head><meta charset="utf-8"></head><body>
<script type="module">
import {render} from './index.js';
await render();
const run = new URLSearchParams(location.search).get('run');
if (run) {  // show that run instead of the first
  const selector = document.querySelector('select.run-selector');
  selector.value = run;
  selector.dispatchEvent(new Event('change'));
}
await new Promise((done) => setTimeout(done, 500));
const out = document.createElement('pre');
out.id = 'measured';
const mesh = document.querySelector('table.mesh');
out.textContent = JSON.stringify({scrollWidth: document.documentElement.scrollWidth,
                                  clientWidth: document.documentElement.clientWidth,
                                  innerWidth: window.innerWidth,
                                  meshRight: mesh ? mesh.getBoundingClientRect().right : -1});
document.body.append(out);
</script></body></html>"""


@pytest.fixture(scope="module")
def dashboard(logdir):
    from tensorboard.plugins.base_plugin import TBContext
    from werkzeug.serving import make_server
    from werkzeug.wrappers import Request, Response

    apps = ParallelPlanPlugin(TBContext(logdir=str(logdir))).get_plugin_apps()

    def wsgi(environ, start_response):
        request = Request(environ)
        if request.path == "/":
            return Response(HARNESS, content_type="text/html")(environ, start_response)
        app = apps.get(request.path)
        if app is None:
            return Response("not found", status=404)(environ, start_response)
        return app(environ, start_response)

    server = make_server("127.0.0.1", 0, wsgi, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()
    thread.join(timeout=10)


def test_the_dashboard_fits_the_window_and_draws_the_mesh(big, dashboard, tmp_path):
    chromium = _chromium()
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; .ci/run installs Debian's chromium")
        pytest.skip("chromium is not installed here (apt-get install chromium)")
    s = big[1].chosen.strategy
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run",
             "--virtual-time-budget=20000", f"--window-size={WINDOW},1200",
             f"--user-data-dir={tmp_path / 'chromium-profile'}"]
    dom = subprocess.run([chromium, *flags, "--dump-dom", dashboard], capture_output=True,
                         text=True, timeout=180).stdout
    found = re.search(r'<pre id="measured">([^<]*)</pre>', dom)
    assert found, dom[-3000:]
    measured = json.loads(found.group(1).replace("&quot;", '"'))
    print(f"dashboard at {DEVICES} devices: {measured}")
    assert measured["innerWidth"] == WINDOW
    # nothing scrolls sideways: the page is as wide as the window (less its scrollbar)
    assert measured["scrollWidth"] <= measured["clientWidth"] <= WINDOW
    assert 0 < measured["meshRight"] <= measured["clientWidth"]
    assert f"dp={s.dp} × tp={s.tp} × pp={s.pp} = 1,536 devices on 192 node(s)" in dom
    mesh = dom[dom.index('class="mesh"'):]
    mesh = mesh[:mesh.index("</table>")]
    assert mesh.count("<tr>") == 1 + s.pp  # the header and a row per stage
    assert mesh.count('class="cell"') == s.pp * min(s.dp, MAX_MESH_COLUMNS)
    assert "node " in mesh and "/job:worker" not in mesh.replace('title="/job:worker', "")
    shots = os.path.join(ROOT, "out", "screenshots")
    os.makedirs(shots, exist_ok=True)
    shot = os.path.join(shots, "parallel_plan_dashboard_1536.png")
    subprocess.run([chromium, *[f for f in flags if not f.startswith("--window-size")],
                    f"--window-size={WINDOW},3000", f"--screenshot={shot}", dashboard],
                   capture_output=True, timeout=180)
    assert os.path.getsize(shot) > 10_000


def test_an_analysis_written_before_the_stage_groups_says_to_rerun(dashboard, tmp_path):
    chromium = _chromium()
    if chromium is None:
        pytest.skip("chromium is not installed here (apt-get install chromium)")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--virtual-time-budget=20000", f"--user-data-dir={tmp_path / 'chromium-profile'}"]
    dom = subprocess.run([chromium, *flags, "--dump-dom", dashboard + "?run=old"],
                         capture_output=True, text=True, timeout=180).stdout
    assert "Run old cannot be shown" in dom and "run plan analyze again" in dom, dom[-3000:]


def test_the_traffic_table_groups_1536_devices_into_a_few_rows(big):
    from tfplan.reports.report import TRAFFIC_HEADER, traffic_rows
    _, result = big
    plan = result.chosen
    rows = traffic_rows(plan)
    assert 1 <= len(rows) <= 4 * plan.strategy.pp  # devices that send the same share a row
    assert sum(int(r[1].replace(",", "")) for r in rows) == len(plan.devices)
    assert all(len(r) == len(TRAFFIC_HEADER) and "/job:" not in r[0] for r in rows)
