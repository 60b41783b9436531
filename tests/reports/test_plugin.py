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
    assert [r["run"] for r in runs["runs"]] == ["pipeline", "searched"]
    assert runs["unreadable"] == []
    doc = json.loads(client.get("/analysis?run=pipeline").data)
    assert doc["plan"]["strategy"]["pp"] == 4
    stage = doc["schedule"]["fields"].index("stage")  # slots are rows of these fields
    assert {s[stage] for s in doc["schedule"]["slots"]} == {0, 1, 2, 3}
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
    yield from _serve(logdir)


def _serve(logdir):
    """A real ``tensorboard --logdir`` on a free port: yields its base URL, then stops it."""
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
    try:
        yield base
    finally:
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


# -- Runs the plugin cannot read (issue 16, "Robustness") ------------------------------

def _analysis_file(root, run):
    path = root / run / "plugins" / PLUGIN_NAME / "analysis.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def mixed_logdir(logdir, tmp_path_factory):
    """One valid run, one whose analysis is cut in half, one of an older schema, one whose
    analysis.json is a symlink out of the logdir, and one linked to a file inside it."""
    root = tmp_path_factory.mktemp("mixed")
    good = (logdir / "searched" / "plugins" / PLUGIN_NAME / "analysis.json").read_bytes()
    _analysis_file(root, "valid").write_bytes(good)
    _analysis_file(root, "corrupt").write_bytes(good[:len(good) // 2])
    old = json.loads(good)
    old["plan"]["schema_version"] = 0
    del old["layers"]
    _analysis_file(root, "old-schema").write_text(json.dumps(old))
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "analysis.json"
    secret = json.loads(good)
    secret["plan"]["model"]["name"] = "SECRET-OUTSIDE"
    elsewhere.write_text(json.dumps(secret))
    _analysis_file(root, "outside").symlink_to(elsewhere)
    _analysis_file(root, "linked").symlink_to(root / "valid" / "plugins" / PLUGIN_NAME /
                                              "analysis.json")
    return root


BAD = {"corrupt": "not valid JSON", "old-schema": "schema_version is 0",
       "outside": "symlink that resolves outside the logdir"}


def test_runs_lists_the_readable_runs_and_the_others_with_the_reason(mixed_logdir):
    client = _client(mixed_logdir)
    response = client.get("/runs")
    assert response.status_code == 200
    body = json.loads(response.data)
    assert [r["run"] for r in body["runs"]] == ["linked", "valid"]
    assert body["runs"][1]["plan"] and body["runs"][1]["model"]
    assert [r["run"] for r in body["unreadable"]] == sorted(BAD)
    for entry in body["unreadable"]:
        assert BAD[entry["run"]] in entry["error"], entry
    assert "line 1, column" in body["unreadable"][0]["error"]
    assert "plan analyze" in body["unreadable"][1]["error"]  # says how to fix it
    assert b"SECRET-OUTSIDE" not in response.data  # the file outside is never read
    assert str(mixed_logdir).encode() not in response.data  # no absolute paths
    assert find_runs(str(mixed_logdir)).keys() == {"corrupt", "old-schema", "valid", "linked"}


@pytest.mark.parametrize("run,status", [("corrupt", 422), ("old-schema", 422),
                                        ("outside", 403), ("missing", 404)])
def test_analysis_of_a_bad_run_is_a_json_error(mixed_logdir, run, status):
    response = _client(mixed_logdir).get("/analysis", query_string={"run": run})
    assert response.status_code == status
    assert response.headers["Content-Type"] == "application/json; charset=utf-8"
    body = json.loads(response.data)
    assert body["run"] == run and body["error"]
    if run in BAD:
        assert BAD[run] in body["error"]
    assert b"SECRET-OUTSIDE" not in response.data


def test_runs_rereads_a_file_that_changed(mixed_logdir, tmp_path):
    client = _client(tmp_path)
    shutil.copytree(mixed_logdir / "valid", tmp_path / "good")
    path = _analysis_file(tmp_path, "later")
    path.write_text("{")  # being written
    body = json.loads(client.get("/runs").data)
    assert [r["run"] for r in body["runs"]] == ["good"]
    assert [r["run"] for r in body["unreadable"]] == ["later"]
    path.write_bytes((tmp_path / "good" / "plugins" / PLUGIN_NAME / "analysis.json").read_bytes())
    body = json.loads(client.get("/runs").data)
    assert [r["run"] for r in body["runs"]] == ["good", "later"] and body["unreadable"] == []


@pytest.mark.parametrize("url,content_type", [
    ("/index.js", "text/javascript; charset=utf-8"),
    ("/runs", "application/json; charset=utf-8"),
    ("/analysis?run=valid", "application/json; charset=utf-8"),
    ("/analysis?run=linked", "application/json; charset=utf-8"),
    ("/analysis?run=corrupt", "application/json; charset=utf-8"),
    ("/analysis?run=outside", "application/json; charset=utf-8"),
    ("/analysis?run=..%2F..", "application/json; charset=utf-8")])
def test_every_response_sets_nosniff_and_its_content_type(mixed_logdir, url, content_type):
    response = _client(mixed_logdir).get(url)
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert response.headers["Content-Type"] == content_type


@pytest.fixture(scope="module")
def mixed_tensorboard(mixed_logdir):
    yield from _serve(mixed_logdir)


def _dump_dom(url: str, tmp_path) -> str:
    chromium = _chromium()
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; .ci/run installs Debian's chromium")
        pytest.skip("chromium is not installed here (apt-get install chromium)")
    profile_dir = tmp_path / "chromium-profile"
    profile_dir.mkdir()
    dom = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile_dir}",
                          "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert "Parallel plan" in dom.stdout, dom.stderr[-2000:]
    return dom.stdout


def test_dashboard_shows_the_valid_run_and_lists_the_unreadable_ones(mixed_tensorboard,
                                                                      tmp_path):
    status, body = _get(mixed_tensorboard + f"/data/plugin/{PLUGIN_NAME}/runs")
    assert status == 200 and len(json.loads(body)["unreadable"]) == 3
    for route in ("index.js", "runs", "analysis?run=valid", "analysis?run=corrupt"):
        try:
            with urllib.request.urlopen(f"{mixed_tensorboard}/data/plugin/{PLUGIN_NAME}/"
                                        + route, timeout=10) as r:
                headers = r.headers
        except urllib.error.HTTPError as e:
            headers = e.headers
        assert headers["X-Content-Type-Options"] == "nosniff", route
    dom = _dump_dom(mixed_tensorboard + f"/data/plugin_entry.html?name={PLUGIN_NAME}", tmp_path)
    assert "Chosen: " in dom and "Pipeline schedule" in dom  # the first valid run, drawn
    assert "3 run(s) could not be read" in dom
    for run, why in BAD.items():
        assert f"<b>{run}</b>: " in dom and why in dom, run
        assert f"{run}: unreadable</option>" in dom
    assert "Loading" not in dom and "SECRET-OUTSIDE" not in dom


def test_dashboard_shows_why_a_listed_run_does_not_load(logdir, tmp_path_factory, tmp_path):
    """A run /runs lists but whose analysis then fails to read (replaced by a damaged file
    of the same size and time, which /runs does not re-read) shows the error, not
    "Loading..."."""
    root = tmp_path_factory.mktemp("stale")
    path = _analysis_file(root, "stale")
    path.write_bytes((logdir / "searched" / "plugins" / PLUGIN_NAME / "analysis.json")
                     .read_bytes())
    server = _serve(root)
    base = next(server)
    try:
        status, body = _get(base + f"/data/plugin/{PLUGIN_NAME}/runs")
        assert [r["run"] for r in json.loads(body)["runs"]] == ["stale"]
        st = os.stat(path)
        path.write_bytes(b"{" + b" " * (st.st_size - 1))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        status, body = _get(base + f"/data/plugin/{PLUGIN_NAME}/analysis?run=stale")
        assert status == 422
        dom = _dump_dom(base + f"/data/plugin_entry.html?name={PLUGIN_NAME}", tmp_path)
        assert "Run stale cannot be shown: analysis.json is not valid JSON" in dom
        assert "Loading" not in dom
    finally:
        server.close()  # stops the TensorBoard even when an assertion failed
