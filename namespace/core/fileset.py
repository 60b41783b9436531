"""A set of files in one directory, replaced all at once: the old set or the new one.

Pipeline position: the bottom layer (``tfplan.core``), under the analysis directory
that ``plan analyze --out DIR`` writes (``reports.analysis_dir``) and under
``planner.load_plan``, which reads a plan.json through it.

Renaming several files one after the other cannot be atomic: an interrupt between two
renames leaves a new plan.json beside an old profile.json. So a commit goes through a
journal directory, as a database's redo log does:

1. ``writing(dir, run_id)`` takes the directory's lock (``flock`` on the directory: one
   writer at a time; the kernel drops it when a writer dies), finishes a commit an
   earlier writer left half done, removes what killed writers left, and yields a staging
   directory ``dir/.tfplan-staging-<run_id>`` for the new files.
2. ``commit(dir, staging, names)`` fsyncs every staged file, writes the order of
   ``names`` into the staging directory and renames it, in one atomic step, to the
   journal ``dir/.tfplan-commit``: from that instant the new set *is* the directory's
   content. Then each name moves from the journal into ``dir`` (files by ``os.replace``;
   a directory after the old one is moved aside), in the given order, the last name
   (the manifest) last, and the emptied journal is removed.
3. Readers see ``dir`` through the journal (``current_path``, ``read_bytes``): a name
   still in the journal is read from there, else from ``dir``. Before step 2's first
   rename they see the complete old set; after it, the complete new one, whichever
   renames a kill interrupted. The next writer completes the moves.

An interrupt while staging leaves only a staging directory, which readers ignore and the
next writer removes. ``TFPLAN_TEST_WRITE_DELAY_S`` (tests only; unset in normal use)
sleeps that many seconds before each rename of a commit, so a test can SIGKILL a writer
inside the commit (tests/cli/test_atomic_analyze.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from typing import Iterator, Sequence

from tfplan.core.atomic import fsync_dir, fsync_file, write_json

JOURNAL = ".tfplan-commit"
STAGING_PREFIX = ".tfplan-staging-"
TRASH = ".tfplan-trash"
ORDER_FILE = ".order.json"
TEST_DELAY_ENV = "TFPLAN_TEST_WRITE_DELAY_S"


def current_path(directory: str | os.PathLike, name: str) -> str:
    """Where ``name`` of the directory's current set is: in the journal while a commit is
    under way (or was interrupted), else in the directory."""
    directory = os.fspath(directory)
    journaled = os.path.join(directory, JOURNAL, name)
    return journaled if os.path.lexists(journaled) else os.path.join(directory, name)


def read_bytes(directory: str | os.PathLike, name: str) -> bytes:
    """The content of ``name`` in the directory's current set (FileNotFoundError if it has
    none). A file moved out of the journal while being looked up is read where it went."""
    directory = os.fspath(directory)
    try:
        with open(os.path.join(directory, JOURNAL, name), "rb") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError):
        pass
    with open(os.path.join(directory, name), "rb") as f:
        return f.read()


@contextlib.contextmanager
def writing(directory: str | os.PathLike, run_id: str) -> Iterator[str]:
    """Lock ``directory`` for writing, tidy it, and yield a fresh staging directory in it.
    The staging directory is removed on leaving if ``commit`` did not consume it."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    with _locked(directory):
        roll_forward(directory)
        _remove_leftovers(directory)
        staging = os.path.join(directory, STAGING_PREFIX + run_id)
        os.mkdir(staging)
        try:
            yield staging
        finally:
            if os.path.isdir(staging):
                shutil.rmtree(staging, ignore_errors=True)


def commit(directory: str | os.PathLike, staging: str, names: Sequence[str]) -> None:
    """Make the staged ``names`` the directory's content, all at once (see the module
    docstring); the last name is moved into place last. Call inside ``writing``."""
    directory = os.fspath(directory)
    for name in names:
        if not os.path.lexists(os.path.join(staging, name)):
            raise FileNotFoundError(f"commit: {name!r} was not staged in {staging!r}")
    _fsync_tree(staging)
    write_json(os.path.join(staging, ORDER_FILE), list(names))
    _delay()
    os.replace(staging, os.path.join(directory, JOURNAL))  # the commit point
    fsync_dir(directory)
    roll_forward(directory)


def roll_forward(directory: str | os.PathLike) -> None:
    """Finish a commit whose journal is still there (idempotent); a no-op without one."""
    directory = os.fspath(directory)
    journal = os.path.join(directory, JOURNAL)
    if not os.path.isdir(journal):
        return
    with open(os.path.join(journal, ORDER_FILE), encoding="utf-8") as f:
        names = json.load(f)  # written before the journal existed: always complete
    for name in names:
        src, dest = os.path.join(journal, name), os.path.join(directory, name)
        if not os.path.lexists(src):
            continue  # moved by the interrupted writer
        _delay()
        if os.path.isdir(src) and os.path.lexists(dest):
            # os.replace cannot put a directory over a non-empty one: move the old aside
            # (readers still see the new one, in the journal), then rename the new in.
            trash = os.path.join(directory, TRASH)
            os.makedirs(trash, exist_ok=True)
            os.replace(dest, os.path.join(trash, f"{name}-{time.time_ns()}"))
            fsync_dir(directory)
            _delay()
        os.replace(src, dest)
        fsync_dir(directory)
    os.unlink(os.path.join(journal, ORDER_FILE))
    os.rmdir(journal)
    fsync_dir(directory)
    shutil.rmtree(os.path.join(directory, TRASH), ignore_errors=True)


def _remove_leftovers(directory: str) -> None:
    """Staging directories and moved-aside old directories of writers that were killed."""
    for entry in os.listdir(directory):
        if entry.startswith(STAGING_PREFIX) or entry == TRASH:
            shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)


@contextlib.contextmanager
def _locked(directory: str) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # Windows: no flock; one writer at a time is then the user's care
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _fsync_tree(root: str) -> None:
    for here, dirs, files in os.walk(root):
        for name in files:
            fsync_file(os.path.join(here, name))
        fsync_dir(here)


def _delay() -> None:
    seconds = os.environ.get(TEST_DELAY_ENV)
    if seconds:
        time.sleep(float(seconds))
