"""Run the whole test suite as several pytest sessions, each on its own two pytest-xdist
workers: ``python -m tests.sessions [pytest options]`` (the README's test command).

Why: TensorFlow keeps memory for what a test traces and runs that Python cannot return
(measured: about 150 MB per SPMD training test, a dp2 x tp2 transformer's step traced and
audited, with every model collected and ``malloc_trim`` called; its function library and
the kernels it instantiated stay). One worker process running half of the suite grew to
9-12 GB, and with the multi-worker tests' own processes beside it a 24 GB machine ran
out of memory and killed a worker. Fresh workers per session bound that: each session's
workers start small.

The sessions: the files under ``tests/apply`` (the engine's tests, which train models on
logical devices) dealt round-robin, largest file first, into ``APPLY_SESSIONS`` sessions,
then every other test file in one. Options are passed to every session (``-m slow``, ``-x``, ``-k``);
given test paths, it runs one session on them. ``--junitxml PATH`` (in the arguments or
``PYTEST_ADDOPTS``, as ``.ci/run`` sets it) gets every session's results merged. The exit
status is the first failing session's (0 when all pass); a session's collected nothing
(pytest's 5) fails too.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
APPLY_SESSIONS = 3
DEFAULT = ["-q", "-n", "2", "--dist", "loadfile"]


def test_files() -> list[str]:
    """Every test file under tests/, relative to the repository root, sorted."""
    out = []
    for folder, _, names in os.walk(os.path.join(ROOT, "tests")):
        out += [os.path.relpath(os.path.join(folder, n), ROOT) for n in names
                if n.startswith("test_") and n.endswith(".py")]
    return sorted(out)


def sessions(files: list[str]) -> list[list[str]]:
    """The files of each session (module docstring)."""
    engine = [f for f in files if f.startswith(os.path.join("tests", "apply") + os.sep)]
    rest = [f for f in files if f not in engine]
    # largest first, so the heavy files spread over the sessions (a file's size is a rough
    # measure of its cost: measured per session, 13.8, 11.2 and 11.3 worker-minutes, where
    # dealing them by name gave 7.8, 20.5 and 8.0)
    engine.sort(key=lambda f: (-os.path.getsize(os.path.join(ROOT, f)), f))
    return [s for s in [engine[i::APPLY_SESSIONS] for i in range(APPLY_SESSIONS)] + [rest] if s]


def split_junit(args: list[str]) -> tuple[list[str], str | None]:
    """``args`` without ``--junitxml``/``--junit-xml`` and the path it named (None)."""
    out, path, skip = [], None, False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        for flag in ("--junitxml", "--junit-xml"):
            if a == flag and i + 1 < len(args):
                path, skip = args[i + 1], True
                break
            if a.startswith(flag + "="):
                path = a.split("=", 1)[1]
                break
        else:
            out.append(a)
    return out, path


def merge_junit(parts: list[str], path: str) -> None:
    """One ``<testsuites>`` of every session's suites, written to ``path``."""
    root = ET.Element("testsuites")
    for part in parts:
        if os.path.exists(part):
            got = ET.parse(part).getroot()
            root.extend([got] if got.tag == "testsuite" else list(got))
            os.remove(part)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def main(argv: list[str]) -> int:
    env = dict(os.environ)
    addopts, junit = split_junit(shlex.split(env.get("PYTEST_ADDOPTS", "")))
    args, given = split_junit(argv)
    junit = given or junit
    env["PYTEST_ADDOPTS"] = shlex.join(addopts)
    paths = [a for a in args if not a.startswith("-")
             and os.path.exists(os.path.join(ROOT, a.split("::")[0]))]
    options = [a for a in args if a not in paths]
    if not any(a == "-n" or a.startswith(("-n", "--numprocesses")) for a in options):
        options = DEFAULT + options
    groups = [paths] if paths else sessions(test_files())
    status, parts = 0, []
    for k, files in enumerate(groups, 1):
        cmd = [sys.executable, "-m", "pytest", *options, *files]
        if junit:
            parts.append(f"{junit}.session{k}")
            cmd.append(f"--junitxml={parts[-1]}")
        print(f"tests.sessions: session {k} of {len(groups)}: {len(files)} files", flush=True)
        start = time.monotonic()
        code = subprocess.call(cmd, cwd=ROOT, env=env)
        print(f"tests.sessions: session {k} exited {code} after "
              f"{time.monotonic() - start:.0f} s", flush=True)
        status = status or code
    if junit:
        merge_junit(parts, junit)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
