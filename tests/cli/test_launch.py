"""`plan launch`: local worker processes, fail-fast, and the cluster descriptions it emits.

The workers here are tiny Python scripts (no TensorFlow): what is checked is the
launcher (TF_CONFIG, PLAN_FILE, prefixes, exit codes, stopping the others).
Training across workers is tests/apply/test_workers.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import yaml

from tfplan.core.presets import parse_cluster
from tfplan.planner.plan import save_plan
from tfplan.planner.search import search
from tests.planner.test_search import chain_profile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRINT_TASK = """\
import json, os, sys
config = json.loads(os.environ["TF_CONFIG"])
print("task", config["task"]["index"], "of", json.dumps(config["cluster"]["worker"]))
print("argv", json.dumps(sys.argv[1:]), "plan", os.environ.get("PLAN_FILE"))
print("to stderr", config["task"]["index"], file=sys.stderr)
"""

ONE_FAILS = """\
import json, os, sys, time
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
pid_file = os.path.join(sys.argv[1], "worker0.pid")
if index == 0:
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)
    time.sleep(60)
    sys.exit(0)
for _ in range(400):  # worker 1 fails once worker 0 is surely running
    if os.path.exists(pid_file):
        break
    time.sleep(0.05)
print("worker 1 gives up", flush=True)
sys.exit(3)
"""


def write_plan(path, cluster: str, dp: int = 2) -> str:
    """A data-parallel plan.json for ``cluster`` (planned from a synthetic profile, no
    TensorFlow): ``2xcpu:1`` names /job:worker/task:0 and task:1, ``cpu:4`` one host."""
    plan = search(chain_profile(n_layers=4, params=1000), parse_cluster(cluster), 32,
                  fix={"dp": dp}).chosen
    save_plan(plan, path)
    return str(path)


def run_plan(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tfplan.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_two_workers_get_their_tf_config_and_prefixes(tmp_path):
    script = tmp_path / "print_task.py"
    script.write_text(PRINT_TASK)
    plan = write_plan(tmp_path / "plan.json", "2xcpu:1")  # a plan for two workers
    r = run_plan("launch", "--workers", "2", "--plan", str(plan), str(script),
                 "--plan", "theirs.json", "-x")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    tasks = {line.split()[3]: line for line in lines if line.split()[2:3] == ["task"]}
    assert set(tasks) == {"0", "1"}
    assert tasks["0"].startswith("[worker 0] task 0 of ")
    assert tasks["1"].startswith("[worker 1] task 1 of ")
    workers = [json.loads(line.split(" of ", 1)[1]) for line in tasks.values()]
    assert workers[0] == workers[1] and len(set(workers[0])) == 2  # one cluster, two ports
    assert all(a.startswith("127.0.0.1:") for a in workers[0])
    # options after SCRIPT belong to the script; --plan before it becomes PLAN_FILE
    for i in (0, 1):
        assert f'[worker {i}] argv ["--plan", "theirs.json", "-x"] plan {plan}' in lines
        assert f"[worker {i}] to stderr {i}" in r.stderr.splitlines()


def test_a_failing_worker_stops_the_others(tmp_path):
    script = tmp_path / "one_fails.py"
    script.write_text(ONE_FAILS)
    start = time.monotonic()
    r = run_plan("launch", "--workers", "2", str(script), str(tmp_path), timeout=50)
    elapsed = time.monotonic() - start
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert elapsed < 20  # worker 0 would sleep 60 s
    assert "[worker 1] worker 1 gives up" in r.stdout
    assert "worker 1 exited with code 3" in r.stderr and "stopping worker(s) [0]" in r.stderr
    pid = int((tmp_path / "worker0.pid").read_text())
    try:
        os.kill(pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive, f"worker 0 (pid {pid}) is still running"


def test_emit_tf_config_is_json_per_host():
    r = run_plan("launch", "--workers", "2", "--emit", "tf-config", "--hosts",
                 "host-a,host-b:2000")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["cluster"] == {"worker": ["host-a:12345", "host-b:2000"]}
    assert [w["TF_CONFIG"]["task"] for w in doc["workers"]] == [
        {"type": "worker", "index": 0}, {"type": "worker", "index": 1}]
    assert all(w["TF_CONFIG"]["cluster"] == doc["cluster"] for w in doc["workers"])


def test_emit_tfjob_is_a_manifest_for_n_workers():
    r = run_plan("launch", "--workers", "2", "--emit", "tfjob", "--plan", "plan.json",
                 "--image", "registry.local/train:1", "examples/train.py", "--steps", "3")
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(r.stdout)
    assert doc["apiVersion"] == "kubeflow.org/v1" and doc["kind"] == "TFJob"
    worker = doc["spec"]["tfReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 2
    (container,) = worker["template"]["spec"]["containers"]
    assert container["name"] == "tensorflow" and container["image"] == "registry.local/train:1"
    assert container["command"] == ["python", "examples/train.py", "--steps", "3"]
    assert container["env"] == [{"name": "PLAN_FILE", "value": "plan.json"}]


def test_launch_errors_are_clear(tmp_path):
    r = run_plan("launch", "--workers", "0", "x.py")
    assert r.returncode == 2 and "--workers is 0" in r.stderr and "Traceback" not in r.stderr
    r = run_plan("launch", "--workers", "2", str(tmp_path / "missing.py"))
    assert r.returncode == 2 and "does not exist" in r.stderr and "missing.py" in r.stderr
    r = run_plan("launch", "--workers", "2")
    assert r.returncode == 2 and "needs a SCRIPT" in r.stderr
    r = run_plan("launch", "--workers", "3", "--emit", "tf-config", "--hosts", "a,b")
    assert r.returncode == 2 and "one host per worker" in r.stderr
    script = tmp_path / "ok.py"
    script.write_text("")
    r = run_plan("launch", "--workers", "2", "--plan", str(tmp_path / "nope.json"),
                 str(script))
    assert r.returncode == 2 and "--plan" in r.stderr and "does not exist" in r.stderr


def test_a_one_host_plan_is_refused_for_several_workers(tmp_path):
    script = tmp_path / "print_task.py"
    script.write_text(PRINT_TASK)
    one_host = write_plan(tmp_path / "one_host.json", "cpu:4")
    r = run_plan("launch", "--workers", "2", "--plan", one_host, str(script))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "PlanMismatchError" in r.stderr
    assert "runs on one host" in r.stderr and "never exchange gradients" in r.stderr
    assert "--cluster 2xcpu:4" in r.stderr  # the plan to make instead
    assert "[worker" not in r.stdout  # nothing started
    # the same plan in one process is fine
    r = run_plan("launch", "--workers", "1", "--plan", one_host, str(script))
    assert r.returncode == 0, r.stderr
    assert "[worker 0] task 0 of " in r.stdout


def test_a_plan_for_other_workers_is_refused(tmp_path):
    script = tmp_path / "print_task.py"
    script.write_text(PRINT_TASK)
    two = write_plan(tmp_path / "two.json", "2xcpu:1")
    r = run_plan("launch", "--workers", "3", "--plan", two, str(script))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "worker task(s) [0, 1]" in r.stderr and "--workers is 3" in r.stderr
    assert "Launch --workers 2" in r.stderr and "--cluster 3xcpu:1" in r.stderr
    r = run_plan("launch", "--workers", "1", "--plan", two, str(script))
    assert r.returncode == 2 and "--workers is 1" in r.stderr
    # two workers of two CPUs each, data parallel over task 0's CPUs only: worker 1 idle
    lopsided = write_plan(tmp_path / "lopsided.json", "2xcpu:2")
    r = run_plan("launch", "--workers", "2", "--plan", lopsided, str(script))
    assert r.returncode == 2 and "worker task(s) [0]" in r.stderr
    # a manifest for the wrong number of workers is refused too (the plan is a file here)
    r = run_plan("launch", "--workers", "3", "--emit", "tfjob", "--plan", two, str(script))
    assert r.returncode == 2 and "--workers is 3" in r.stderr
    r = run_plan("launch", "--workers", "2", "--emit", "tfjob", "--plan", two, str(script))
    assert r.returncode == 0, r.stderr


KILLED_ONCE = """\
import json, os, signal, sys, time
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
attempt = int(os.environ["PLAN_LAUNCH_ATTEMPT"])
with open(os.path.join(sys.argv[1], f"started-{index}-{attempt}"), "w") as f:
    f.write(os.environ["TF_CONFIG"])
deadline = time.time() + 30  # worker 0 started too before worker 1 dies (a loaded machine
while index == 1 and time.time() < deadline and not os.path.exists(  # starts it late)
        os.path.join(sys.argv[1], f"started-0-{attempt}")):
    time.sleep(0.05)
if index == 1 and attempt < int(sys.argv[2]):
    os.kill(os.getpid(), signal.SIGKILL)  # killed, as by the OOM killer or a lost machine
if index == 1 and sys.argv[3] == "error":
    sys.exit(5)
time.sleep(0.5 if index == 1 else 0.2)
print("done", index, attempt, flush=True)
"""


def _started(tmp_path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("started-"))


def test_restarts_start_the_job_again_after_a_worker_is_killed(tmp_path):
    script = tmp_path / "killed_once.py"
    script.write_text(KILLED_ONCE)
    r = run_plan("launch", "--workers", "2", "--restarts", "1", str(script), str(tmp_path),
                 "1", "ok", timeout=60)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert _started(tmp_path) == ["started-0-0", "started-0-1", "started-1-0", "started-1-1"]
    assert "worker 1 was killed (exit code 137); starting all 2 worker(s) again (restart 1 " \
           "of 1)" in r.stderr
    assert "[worker 0] done 0 1" in r.stdout and "[worker 1] done 1 1" in r.stdout
    # the second run is a new cluster: new ports
    first, second = ((tmp_path / f"started-0-{a}").read_text() for a in (0, 1))
    assert json.loads(first)["cluster"] != json.loads(second)["cluster"]


def test_restarts_run_out_and_errors_are_not_restarted(tmp_path):
    script = tmp_path / "killed_once.py"
    script.write_text(KILLED_ONCE)
    r = run_plan("launch", "--workers", "2", "--restarts", "1", str(script), str(tmp_path),
                 "2", "ok", timeout=60)  # killed in both runs: one restart, then its code
    assert r.returncode == 137, (r.stdout, r.stderr)
    assert _started(tmp_path) == ["started-0-0", "started-0-1", "started-1-0", "started-1-1"]
    for p in tmp_path.iterdir():
        if p.name.startswith("started-"):
            p.unlink()
    r = run_plan("launch", "--workers", "2", "--restarts", "3", str(script), str(tmp_path),
                 "0", "error", timeout=60)  # an error exit: reported, never restarted
    assert r.returncode == 5, (r.stdout, r.stderr)
    assert _started(tmp_path) == ["started-0-0", "started-1-0"]
    assert "worker 1 exited with code 5" in r.stderr and "restart" not in r.stderr
    r = run_plan("launch", "--workers", "2", "--restarts", "-1", str(script))
    assert r.returncode == 2 and "0 or more restarts" in r.stderr
