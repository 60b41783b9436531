"""tfplan.core.atomic and tfplan.core.fileset: a file is the old content or the new one,
a set of files is the old set or the new one, whatever rename an interrupt stops at, and
an unwritable output location is a typed error before any work.

Interrupts are injected by making the k-th ``os.replace`` raise (a crash between two
renames: nothing after it runs), for every k; the SIGKILL version, on the real
``plan analyze``, is tests/cli/test_atomic_analyze.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tfplan.core import atomic, fileset
from tfplan.core.errors import OutputPathError, PlannerError

NAMES = ("a.json", "b.json", "sub", "manifest.json")


class Crash(BaseException):
    """Stands for the process dying: not an Exception, nothing catches it."""


def crash_at_replace(monkeypatch, k: int) -> None:
    """Make the k-th os.replace from now (0-based) 'kill' the writer instead of renaming."""
    real = os.replace
    calls = {"n": 0}

    def replace(src, dst, *args, **kwargs):
        if calls["n"] == k:
            raise Crash(f"killed before rename {k}: {src} -> {dst}")
        calls["n"] += 1
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)


def write_set(directory, tag: str) -> None:
    """Commit a set whose every file says ``tag``."""
    with fileset.writing(directory, f"run{tag}") as staging:
        for name in ("a.json", "b.json", "manifest.json"):
            atomic.write_json(os.path.join(staging, name), {"tag": tag})
        os.makedirs(os.path.join(staging, "sub"))
        atomic.write_text(os.path.join(staging, "sub", "c.txt"), tag)
        fileset.commit(directory, staging, NAMES)


def read_set(directory) -> set[str]:
    """The tag of every member of the directory's current set, as a reader sees it."""
    tags = {json.loads(fileset.read_bytes(directory, n))["tag"]
            for n in ("a.json", "b.json", "manifest.json")}
    with open(os.path.join(fileset.current_path(directory, "sub"), "c.txt")) as f:
        tags.add(f.read())
    return tags


# --- one file --------------------------------------------------------------------

def test_write_replaces_the_whole_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "x.json"
    atomic.write_json(path, {"v": 1})
    atomic.write_text(path, "new")
    assert path.read_text() == "new"
    atomic.write_bytes(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    assert os.listdir(tmp_path) == ["x.json"]


def test_a_write_that_dies_leaves_the_old_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    atomic.write_json(path, {"v": "old" * 1000})
    crash_at_replace(monkeypatch, 0)
    with pytest.raises(Crash):
        atomic.write_json(path, {"v": "new"})
    assert json.loads(path.read_text()) == {"v": "old" * 1000}
    assert os.listdir(tmp_path) == ["plan.json"]  # the temporary file was removed


def test_new_files_get_the_usual_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        atomic.write_text(tmp_path / "f", "x")
    finally:
        os.umask(old)
    assert (os.stat(tmp_path / "f").st_mode & 0o777) == 0o644


def test_copy_file(tmp_path):
    (tmp_path / "src").write_bytes(b"abc" * 1000)
    atomic.copy_file(tmp_path / "src", tmp_path / "dest")
    assert (tmp_path / "dest").read_bytes() == b"abc" * 1000


# --- a set of files ---------------------------------------------------------------

def test_a_set_is_replaced_whole(tmp_path):
    write_set(tmp_path, "1")
    assert read_set(tmp_path) == {"1"}
    write_set(tmp_path, "2")
    assert read_set(tmp_path) == {"2"}
    assert sorted(os.listdir(tmp_path)) == sorted(NAMES)  # no journal, staging or trash left


RENAMES = 11  # per write_set after the first: 4 staged files, the order, the journal, 5 moves


@pytest.mark.parametrize("k", range(RENAMES + 1))
def test_a_commit_killed_at_any_rename_reads_as_the_old_or_the_new_set(tmp_path, monkeypatch, k):
    write_set(tmp_path, "old")
    crash_at_replace(monkeypatch, k)
    try:
        write_set(tmp_path, "new")
        died = False
    except Crash:
        died = True
    monkeypatch.undo()
    # The renames of one write_set: the staged files' temporaries (0-3), the journal's
    # order file (4), the journal (5: the commit point), then the members (the old "sub"
    # moved aside first, the manifest last). A crash before the journal's rename leaves
    # the old set, any later one the new set.
    seen = read_set(tmp_path)
    assert seen in ({"old"}, {"new"})
    journal = os.path.isdir(tmp_path / fileset.JOURNAL)
    assert seen == ({"new"} if journal or not died else {"old"})
    # The next writer finishes or discards what the dead one left, then commits its own.
    write_set(tmp_path, "next")
    assert read_set(tmp_path) == {"next"}
    assert sorted(os.listdir(tmp_path)) == sorted(NAMES)


def test_every_interrupt_point_is_covered(tmp_path, monkeypatch):
    """The parametrisation above reaches past the last rename of a commit."""
    write_set(tmp_path, "old")
    real, calls = os.replace, []
    monkeypatch.setattr(os, "replace", lambda s, d: (calls.append(d), real(s, d)))
    write_set(tmp_path, "new")
    assert len(calls) == RENAMES and calls[-1] == os.path.join(tmp_path, "manifest.json")


def test_a_reader_sees_the_new_set_through_an_interrupted_journal(tmp_path, monkeypatch):
    write_set(tmp_path, "old")
    crash_at_replace(monkeypatch, 7)  # the journal is in place, a.json moved, b.json not
    with pytest.raises(Crash):
        write_set(tmp_path, "new")
    monkeypatch.undo()
    assert os.path.isdir(tmp_path / fileset.JOURNAL)
    on_disk = {json.loads((tmp_path / n).read_text())["tag"] for n in ("a.json", "b.json")}
    assert on_disk == {"old", "new"}  # a mix on disk ...
    assert read_set(tmp_path) == {"new"}  # ... that no reader through the journal sees
    fileset.roll_forward(tmp_path)
    assert read_set(tmp_path) == {"new"} and not os.path.exists(tmp_path / fileset.JOURNAL)


def test_a_writer_killed_while_staging_leaves_the_old_set_and_its_staging_is_removed(tmp_path):
    write_set(tmp_path, "old")
    with pytest.raises(Crash):
        with fileset.writing(tmp_path, "dead") as staging:
            atomic.write_json(os.path.join(staging, "a.json"), {"tag": "new"})
            raise Crash()
    assert read_set(tmp_path) == {"old"}
    os.mkdir(tmp_path / (fileset.STAGING_PREFIX + "killed"))  # what SIGKILL would leave
    write_set(tmp_path, "next")
    assert sorted(os.listdir(tmp_path)) == sorted(NAMES)


def test_the_test_delay_slows_each_rename(tmp_path, monkeypatch):
    import time
    write_set(tmp_path, "old")
    monkeypatch.setenv(fileset.TEST_DELAY_ENV, "0.05")
    t = time.perf_counter()
    write_set(tmp_path, "new")
    assert time.perf_counter() - t >= 0.05 * 5  # journal + 4 members (+ the old sub aside)


# --- output locations ---------------------------------------------------------------

def test_a_writable_directory_is_created(tmp_path):
    assert atomic.check_writable_dir(tmp_path / "a" / "b", "--out") == str(tmp_path / "a" / "b")
    assert os.listdir(tmp_path / "a" / "b") == []  # the probe is gone


def test_a_directory_under_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputPathError) as e:
        atomic.check_writable_dir(tmp_path / "f" / "out", "--out")
    assert str(tmp_path / "f" / "out") in str(e.value) and "Not a directory" in str(e.value)
    assert isinstance(e.value, PlannerError) and e.value.exit_code == 2
    with pytest.raises(OutputPathError, match="exists and is not a directory"):
        atomic.check_writable_dir(tmp_path / "f", "--out")
    with pytest.raises(OutputPathError, match="is a file, not a directory"):
        atomic.check_writable_file(tmp_path / "f" / "r.html", "--html")
    with pytest.raises(OutputPathError, match="is a directory"):
        atomic.check_writable_file(tmp_path, "--html")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(OutputPathError, match="Permission denied"):
            atomic.check_writable_dir(ro, "--out")
        with pytest.raises(OutputPathError, match="Permission denied"):
            atomic.check_writable_file(ro / "c.json", "--out")
    finally:
        ro.chmod(0o700)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sysfs is Linux's")
def test_a_place_without_permission_is_refused():
    # Even root may not create entries in sysfs: EPERM, or EACCES, or EROFS.
    with pytest.raises(OutputPathError) as e:
        atomic.check_writable_dir("/sys/tfplan-test-out", "--out")
    assert "/sys/tfplan-test-out" in str(e.value)
    assert e.value.reason.split("(")[-1].rstrip(")") in ("EPERM", "EACCES", "EROFS")


def test_core_atomic_needs_no_tensorflow():
    code = ("import sys, tfplan.core.atomic, tfplan.core.fileset; "
            "print('tensorflow' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr
