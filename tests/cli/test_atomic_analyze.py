"""`plan analyze --out DIR` survives SIGKILL while it writes, and every output location is
checked before any slow work (issue 13).

The acceptance test makes a previous analysis with the real ``plan`` command, then
starts twenty new ``plan analyze`` runs (each with another --global-batch, so the new set
differs) and SIGKILLs each at a random moment of its write phase. The runs are forked
from one process that imported TensorFlow once (tests/cli/analyze_forkserver.py; each
child runs ``tfplan.cli.main``, what the ``plan`` entry point runs): about 1.3 s a run
instead of 6 s. ``TFPLAN_TEST_WRITE_DELAY_S`` (read only by ``core.fileset``; unset in
normal use) sleeps 30 ms before each rename of the commit, so that the ~1 ms commit is a
window a kill can land in. Kill moments are random within the
write phase: half of them in the staging of the new files, half in the commit (both timed
on an unkilled run first; the kill is timed from the moment the staging directory, or
the journal, appears). After each kill the directory must read as the complete previous
analysis or the complete new one -- which one follows from where the kill landed (a
staging directory left: previous; the journal left, or nothing: new) -- and
``plan report`` and ``apply.wrap`` must both accept exactly that one.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tfplan.core import fileset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KILLS = 20
DELAY_S = 0.03
BATCHES = (32, 48, 64, 96, 128)


def run_plan(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "tfplan.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def analyze_argv(out_dir, global_batch: int) -> list[str]:
    return ["analyze", os.path.join(ROOT, "examples", "mlp.py"), "--cluster", "cpu:4",
            "--global-batch", str(global_batch), "--out", str(out_dir)]


class ForkServer:
    def __init__(self, tmp_path) -> None:
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT,
                   **{fileset.TEST_DELAY_ENV: str(DELAY_S)})
        self.tmp_path = tmp_path
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cli.analyze_forkserver"],
                                     cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def ready(self) -> None:
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def start(self, argv: list[str]) -> int:
        log = str(self.tmp_path / "child.log")
        self.proc.stdin.write(json.dumps({"argv": argv, "log": log}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["pid"]

    def wait(self, pid: int) -> int:
        reply = json.loads(self.proc.stdout.readline())
        assert reply["pid"] == pid
        return reply["status"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def has_staging(entries) -> bool:
    return any(e.startswith(fileset.STAGING_PREFIX) for e in entries)


def wait_until(out_dir, pid: int, seen, timeout: float = 120) -> float:
    """Poll the directory every 2 ms until ``seen(entries)``; return that moment."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if seen(os.listdir(out_dir)):
            return time.monotonic()
        time.sleep(0.002)
    raise AssertionError(f"run {pid}: the directory never reached the awaited state")


def report(out_dir, capsys) -> dict:
    """``plan report DIR --json`` (tfplan.cli.main, in this process)."""
    from tfplan.cli import main
    capsys.readouterr()
    rc = main(["report", str(out_dir), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out)


def wrapped_global_batch(out_dir) -> int:
    """apply.wrap given DIR/plan.json: the plan it trains with."""
    from examples.mlp import build_model
    from tfplan.apply.wrap import wrap
    return wrap(build_model(), os.path.join(str(out_dir), "plan.json")).plan.global_batch


def test_sigkill_while_writing_leaves_the_previous_or_the_new_analysis(tmp_path, capsys):
    out = tmp_path / "out"
    t0 = time.perf_counter()
    server = ForkServer(tmp_path)  # starts importing while the first analysis runs
    try:
        first = run_plan(*analyze_argv(out, 64))  # the previous analysis, by the real command
        assert first.returncode == 0, first.stderr
        prev = report(out, capsys)
        assert prev["plan"]["global_batch"] == 64 and wrapped_global_batch(out) == 64
        server.ready()

        # One unkilled run times the two parts of the write phase (and makes global batch
        # 32 the previous analysis): staging (the files and the TensorBoard run written
        # under a temporary directory) and the commit (the journal in place, its members
        # moved in, DELAY_S before each rename).
        pid = server.start(analyze_argv(out, 32))
        staged = wait_until(out, pid, has_staging)
        journaled = wait_until(out, pid, lambda e: fileset.JOURNAL in e)
        committed = wait_until(out, pid, lambda e: fileset.JOURNAL not in e)
        assert server.wait(pid) == 0, (tmp_path / "child.log").read_text()
        staging_s, commit_s = journaled - staged, committed - journaled
        prev = report(out, capsys)
        assert prev["plan"]["global_batch"] == 32
        assert commit_s > 5 * DELAY_S  # the delayed renames

        rng = random.Random(13)
        seen_ids = {prev["run_id"]}
        landed = {"staging": 0, "journal": 0, "done": 0}
        for i in range(KILLS):
            new_batch = rng.choice([b for b in BATCHES if b != prev["plan"]["global_batch"]])
            left = set(os.listdir(out))  # what the last killed run left
            pid = server.start(analyze_argv(out, new_batch))
            # this run's staging directory (it first finishes or removes what was left)
            staged = wait_until(out, pid, lambda e: has_staging(set(e) - left))
            # Half the kills at a random moment of staging, half of the commit.
            if i % 2 == 0:
                kill_at = staged + rng.uniform(0, staging_s)
            else:
                kill_at = wait_until(out, pid, lambda e: fileset.JOURNAL in e) + rng.uniform(
                    0, commit_s)
            time.sleep(max(0.0, kill_at - time.monotonic()))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            server.wait(pid)

            entries = os.listdir(out)
            if fileset.JOURNAL in entries:
                where = "journal"
            elif any(e.startswith(fileset.STAGING_PREFIX) for e in entries):
                where = "staging"
            else:
                where = "done"
            landed[where] += 1
            now = report(out, capsys)
            if where == "staging":  # killed before the commit point: the previous set
                assert now == prev, f"kill {i} ({where})"
            else:  # the journal was in place: the new set, whole
                assert now["plan"]["global_batch"] == new_batch, f"kill {i} ({where})"
                assert now["run_id"] not in seen_ids
                assert {c["model"]["fingerprint"] for c in now["candidates"]} == {
                    now["plan"]["model"]["fingerprint"]}
            # apply.wrap reads plan.json alone: the same plan plan report describes
            assert wrapped_global_batch(out) == now["plan"]["global_batch"], f"kill {i}"
            seen_ids.add(now["run_id"])
            prev = now

        # The next run finishes or removes what the killed ones left, and commits.
        pid = server.start(analyze_argv(out, 256))
        assert server.wait(pid) == 0, (tmp_path / "child.log").read_text()
    finally:
        server.close()
    final = run_plan("report", str(out), "--json")  # the real command, once
    assert final.returncode == 0 and json.loads(final.stdout)["plan"]["global_batch"] == 256
    assert not [e for e in os.listdir(out) if e.startswith(".tfplan-")]
    elapsed = time.perf_counter() - t0
    print(f"kills landed: {landed}; staging {staging_s:.2f} s, commit {commit_s:.2f} s; "
          f"test {elapsed:.1f} s")
    # The kills must have hit both sides of the commit point, or the test proved little.
    assert landed["staging"] >= 3 and landed["journal"] >= 3, landed


# --- unwritable output locations: exit 2, the path named, no traceback, no slow work ------

def _no_tensorflow_run(*args: str) -> subprocess.CompletedProcess:
    """Run ``plan ARGS`` in a process that then says whether TensorFlow was imported
    (profiling, measuring and TensorBoard all need it: not imported = no slow work)."""
    code = ("import sys; from tfplan.cli import main; rc = main(sys.argv[1:]); "
            "print('tensorflow imported:', 'tensorflow' in sys.modules); sys.exit(rc)")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def unwritable_places(tmp_path) -> list[tuple[str, tuple[str, ...]]]:
    """(a path, the system's words for why it cannot be written, any of them): under a
    file; in sysfs (no permission, even for root); in a read-only directory (not root)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    places = [(str(a_file / "out"), ("Not a directory",))]
    if sys.platform.startswith("linux"):
        places.append(("/sys/tfplan-test-out/x", ("not permitted", "Permission denied",
                                                  "Read-only file system")))
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        places.append((str(ro / "out"), ("Permission denied",)))
    return places


def assert_refused(r: subprocess.CompletedProcess, path: str, reasons: tuple[str, ...]) -> None:
    assert r.returncode == 2, r.stderr
    assert path in r.stderr and any(w in r.stderr for w in reasons), r.stderr
    assert "Traceback" not in r.stderr
    assert "tensorflow imported: False" in r.stdout


def test_analyze_to_an_unwritable_out_fails_before_profiling(tmp_path):
    for path, reason in unwritable_places(tmp_path):
        r = _no_tensorflow_run(*analyze_argv(path, 64))
        assert_refused(r, path, reason)
        assert "--out" in r.stderr


def test_report_html_to_an_unwritable_place_fails_first(tmp_path):
    for path, reason in unwritable_places(tmp_path):
        html = os.path.join(path, "report.html")
        r = _no_tensorflow_run("report", str(tmp_path), "--html", html)  # no analysis there:
        assert_refused(r, html, reason)  # the --html check comes first
        assert "--html" in r.stderr


def test_profile_hardware_out_to_an_unwritable_place_fails_before_measuring(tmp_path):
    for path, reason in unwritable_places(tmp_path):
        target = os.path.join(path, "cluster.json")
        r = _no_tensorflow_run("profile-hardware", "--quick", "--out", target)
        assert_refused(r, target, reason)


def test_profile_measure_logdir_that_is_unwritable_fails_before_profiling(tmp_path):
    for path, reason in unwritable_places(tmp_path):
        r = _no_tensorflow_run("profile", "examples/mlp.py", "--measure", "--logdir", path)
        assert_refused(r, path, reason)
        assert "--logdir" in r.stderr


def test_an_out_that_is_a_file_is_still_refused_by_name(tmp_path):
    f = tmp_path / "plan-out"
    f.write_text("x")
    r = _no_tensorflow_run(*analyze_argv(f, 64))
    assert_refused(r, str(f), ("exists and is not a directory",))


# --- truncated or mixed analysis directories at the command line ---------------------------

@pytest.fixture(scope="module")
def analyses(tmp_path_factory):
    """Two real analyses of examples/mlp.py (global batch 64 and 32)."""
    root = tmp_path_factory.mktemp("analyses")
    for b in (64, 32):
        r = run_plan(*analyze_argv(root / str(b), b))
        assert r.returncode == 0, r.stderr
    return root


@pytest.mark.parametrize("name", ["plan.json", "profile.json", "candidates.json",
                                  "manifest.json"])
def test_report_on_a_truncated_file_names_it(analyses, tmp_path, name):
    out = tmp_path / "out"
    shutil.copytree(analyses / "64", out)
    data = (out / name).read_bytes()
    (out / name).write_bytes(data[:len(data) // 2])
    r = run_plan("report", str(out))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert str(out / name) in r.stderr and "truncated" in r.stderr
    assert "Re-run plan analyze" in r.stderr


def test_report_on_a_mixed_set_names_the_file_of_the_other_run(analyses, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(analyses / "64", out)
    shutil.copyfile(analyses / "32" / "plan.json", out / "plan.json")
    r = run_plan("report", str(out))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert str(out / "plan.json") in r.stderr and "another plan analyze run" in r.stderr
    mlp = os.path.join(ROOT, "examples", "mlp.py")  # what to re-run, the model included
    assert f"Re-run plan analyze {mlp} --cluster cpu:4 --global-batch 64 --out {out}" in r.stderr
