"""The "Parallel plan" TensorBoard plugin: its routes on a werkzeug test client, then a
real `tensorboard --logdir` on 127.0.0.1 with the dashboard rendered by headless
Chromium (Debian's `chromium`, installed by .ci/run)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tfplan.planner.search import search
from tfplan.reports.plugin import PLUGIN_NAME, ParallelPlanPlugin, find_runs
from tfplan.reports.tensorboard import write_analysis
from tests.planner.gpt_profile import gpt_profile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHOTS = os.path.join(ROOT, "out", "screenshots")


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    from tfplan.core.presets import parse_cluster
    root = tmp_path_factory.mktemp("logdir")
    profile = gpt_profile(4, 512, 8, vocab=4096, seq=256)
    cluster = parse_cluster("8xA100-80GB")
    for run, fix in (("pipeline", {"pp": 4, "microbatch_size": 1, "schedule": "1f1b"}),
                     ("searched", None)):
        result = search(profile, cluster, 16, fix=fix)
        write_analysis(root / run, profile, result.chosen, result.candidates)
    (root / "secret.json").write_text('{"secret": true}')
    return root


def _client(logdir):
    from tensorboard.plugins.base_plugin import TBContext
    from werkzeug.test import Client
    from werkzeug.wrappers import Request, Response

    apps = ParallelPlanPlugin(TBContext(logdir=str(logdir))).get_plugin_apps()

    def wsgi(environ, start_response):
        request = Request(environ)
        app = apps.get(request.path)
        if app is None:
            return Response("not found", status=404)(environ, start_response)
        return app(environ, start_response)
    return Client(wsgi)


def test_routes_list_the_runs_and_serve_their_plans(logdir):
    assert sorted(find_runs(str(logdir))) == ["pipeline", "searched"]
    client = _client(logdir)
    runs = json.loads(client.get("/runs").data)
    assert [r["run"] for r in runs] == ["pipeline", "searched"]
    doc = json.loads(client.get("/analysis?run=pipeline").data)
    assert doc["plan"]["strategy"]["pp"] == 4
    assert {s["stage"] for s in doc["schedule"]["slots"]} == {0, 1, 2, 3}
    assert len(doc["layers"]) == len(gpt_profile(4, 512, 8, vocab=4096, seq=256).layers)
    js = client.get("/index.js")
    assert js.status_code == 200 and b"export async function render" in js.data
    assert b"http://" not in js.data.replace(b"http://www.w3.org/2000/svg", b"")


@pytest.mark.parametrize("run", ["..", "../..", "/etc", "pipeline/../..", "secret.json",
                                 "%2e%2e%2fsecret.json", ""])
def test_paths_outside_the_runs_are_refused(logdir, run):
    response = _client(logdir).get("/analysis", query_string={"run": run})
    assert response.status_code == 404
    assert b'"secret": true' not in response.data  # the file outside the runs is not read


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def tensorboard(logdir):
    port = _free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    proc = subprocess.Popen([exe, "--logdir", str(logdir), "--host", "127.0.0.1", "--port",
                             str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            status, body = _get(base + "/data/plugins_listing")
            if status == 200 and PLUGIN_NAME in json.loads(body):
                break
        except (OSError, ValueError):
            pass
        if proc.poll() is not None:
            raise RuntimeError("tensorboard exited: " + proc.stdout.read().decode()[-2000:])
        time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError("tensorboard did not list the plugin within 90 s")
    yield base
    proc.terminate()
    proc.wait(timeout=20)


def test_tensorboard_lists_the_plugin_and_serves_the_plan(tensorboard):
    listing = json.loads(_get(tensorboard + "/data/plugins_listing")[1])
    assert listing[PLUGIN_NAME]["enabled"] is True
    assert listing[PLUGIN_NAME]["tab_name"] == "Parallel plan"
    status, body = _get(tensorboard + f"/data/plugin/{PLUGIN_NAME}/analysis?run=searched")
    assert status == 200 and json.loads(body)["plan"]["name"]
    status, body = _get(tensorboard + f"/data/plugin/{PLUGIN_NAME}/analysis?run=..%2Fsecret")
    assert status == 404 and b"secret\": true" not in body


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--virtual-time-budget=15000"]


def test_dashboard_renders_in_headless_chromium(tensorboard, tmp_path):
    chromium = _chromium()
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; .ci/run installs Debian's chromium")
        pytest.skip("chromium is not installed here (apt-get install chromium)")
    url = tensorboard + f"/data/plugin_entry.html?name={PLUGIN_NAME}"
    profile_dir = tmp_path / "chromium-profile"
    profile_dir.mkdir()
    flags = CHROMIUM_FLAGS + [f"--user-data-dir={profile_dir}"]
    dom = subprocess.run([chromium, *flags, "--dump-dom", url], capture_output=True,
                         text=True, timeout=120)
    assert "Parallel plan" in dom.stdout, dom.stderr[-2000:]
    assert "Chosen: " in dom.stdout and "Pipeline schedule" in dom.stdout
    assert "Device mesh and placement" in dom.stdout and "stage 0" in dom.stdout
    os.makedirs(SHOTS, exist_ok=True)
    shot = os.path.join(SHOTS, "parallel_plan_dashboard.png")
    subprocess.run([chromium, *flags, "--window-size=1200,1800", f"--screenshot={shot}", url],
                   capture_output=True, timeout=120)
    assert os.path.getsize(shot) > 10_000
