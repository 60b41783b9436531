"""Atomic file writes and the writability check every output location gets first.

Pipeline position: the bottom layer (``tfplan.core``), used by every stage that writes
a file: the planner's ``save_plan``, the CLI's profile and cluster files, the reports'
candidates, HTML page and TensorBoard ``analysis.json``, ``apply.wrap``'s logdir files.
A file is written to a temporary file in the same directory, flushed, fsynced, renamed
over the target with ``os.replace`` (atomic on POSIX and Windows) and the directory
fsynced, so a reader -- or the file after an interrupt or a power loss -- holds either
the whole old content or the whole new one, never a truncated mix.

``check_writable_dir`` / ``check_writable_file`` create the location and a probe file
before any slow work, and raise ``OutputPathError`` naming the path and the operating
system's reason (a path under a file, a read-only file system, no permission).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import uuid
from typing import Any, Iterator

from tfplan.core.errors import OutputPathError

TMP_PREFIX = ".tfplan-tmp-"


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (temp file, fsync, rename, fsync dir)."""
    with replacing(path) as tmp:
        # O_EXCL: never reuse someone else's file; mode 0o666 less the umask, like open(path, "w").
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                     0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path beside ``path`` for the caller to fill and fsync; then rename
    it over ``path`` and fsync the directory (or remove it if the caller raised). The
    temporary name ends with ``path``'s own name, so writers that check a suffix (Keras'
    ``.weights.h5``) accept it."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f"{TMP_PREFIX}{uuid.uuid4().hex[:12]}-{os.path.basename(path)}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory)


def write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """Replace ``path`` with ``text`` atomically."""
    write_bytes(path, text.encode(encoding))


def write_json(path: str | os.PathLike, doc: Any, indent: int | None = 2) -> None:
    """Replace ``path`` with ``doc`` as JSON (and a final newline) atomically."""
    write_text(path, json.dumps(doc, indent=indent) + "\n")


def copy_file(src: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Copy ``src`` to ``dest`` atomically (``dest`` is never seen half-copied)."""
    with replacing(dest) as tmp:
        shutil.copyfile(src, tmp)
        fsync_file(tmp)


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # Windows: directories cannot be opened; renames there are durable
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def os_reason(e: OSError) -> str:
    """'Permission denied (EACCES)': the operating system's words for ``e``."""
    name = errno.errorcode.get(e.errno, "") if e.errno is not None else ""
    text = e.strerror or str(e)
    return f"{text} ({name})" if name else text


def check_writable_dir(path: str | os.PathLike, option: str) -> str:
    """Create directory ``path`` (and its parents) and a probe file in it; return its
    absolute path. OutputPathError naming ``option``, the path and the OS reason if not."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise OutputPathError(f"{option} {path!r} exists and is not a directory; pass a "
                              "directory path.", path, "not a directory")
    _make_and_probe(path, option, path, "the directory", "a directory you can write to")
    return path


def check_writable_file(path: str | os.PathLike, option: str) -> str:
    """Check that file ``path`` can be written (its directory is created and probed, and
    ``path`` is not a directory); return its absolute path. OutputPathError if not."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        raise OutputPathError(f"{option} {path!r} is a directory; pass a file path.",
                              path, "is a directory")
    directory = os.path.dirname(path)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise OutputPathError(f"{option} {path!r}: {directory!r} is a file, not a directory. "
                              "Pass a path in a directory you can write to.", path,
                              "not a directory")
    _make_and_probe(directory, option, path, f"its directory {directory!r}",
                    "a path in a directory you can write to")
    return path


def _make_and_probe(directory: str, option: str, path: str, what: str, expected: str) -> None:
    """Create ``directory`` (parents too) and write a probe file in it; OutputPathError
    naming ``option``, ``path`` and the OS reason if either fails."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise OutputPathError(f"{option} {path!r}: cannot create {what}: {os_reason(e)}. "
                              f"Pass {expected}.", path, os_reason(e)) from None
    _probe(directory, option, path)


def _probe(directory: str, option: str, path: str) -> None:
    probe = os.path.join(directory, f"{TMP_PREFIX}probe-{uuid.uuid4().hex[:12]}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OutputPathError(
            f"{option} {path!r}: cannot write in {directory!r}: {os_reason(e)}. Pass a "
            "location you can write to.", path, os_reason(e)) from None
