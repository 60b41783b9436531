"""Fuzzing the `plan` command: random and malformed arguments, cluster files, plan files
and analysis directories must end in a typed error (exit 2, 3 or 4) or success --
never a Python traceback (exit 1, an exception escaping ``main``) and never a hang.

The cases call ``tfplan.cli.main(argv)`` in-process (a subprocess each would take a
second apiece) from a seeded random generator, so a failure names a case that
reproduces. Almost every case fails in argument, cluster or file parsing, before any
profiling; the ones that reach the search use examples/mlp.py, whose profile is
computed once (``_cached_profiles``: the real profiler, memoised per model and
options) so the loop stays fast.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import random
import signal
import time
import traceback

import pytest

import tfplan.cli as cli
from tfplan.core.presets import parse_cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MLP = os.path.join(ROOT, "examples", "mlp.py")
SEED = 13
CASE_TIMEOUT_S = 30  # one case; the first one that profiles imports TensorFlow
ALLOWED_EXITS = {0, 2, 3, 4}


class CaseTimeout(Exception):
    pass


def run_case(argv: list[str]) -> tuple[int, str, str]:
    """``plan ARGV`` in this process: (exit code, stdout, stderr). An exception escaping
    ``main`` is returned as exit 1 with its traceback on stderr, as the shell shows it."""
    out, err = io.StringIO(), io.StringIO()

    def alarm(signum, frame):  # a hang: ends the case as a failure, with where it hung
        raise CaseTimeout(f"ran past {CASE_TIMEOUT_S} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(CASE_TIMEOUT_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(argv)
            except SystemExit as e:  # argparse: --help, --version, usage errors
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
            except BaseException:  # noqa: BLE001  (what a user would see as a traceback)
                err.write(traceback.format_exc())
                code = 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return code, out.getvalue(), err.getvalue()


def problem(argv: list[str], code: int, err: str) -> str | None:
    """What is wrong with how ``plan ARGV`` ended (None: a clean exit)."""
    if code not in ALLOWED_EXITS or "Traceback (most recent call last)" in err:
        return f"plan {' '.join(map(repr, argv))} -> exit {code}\n{err[-2500:]}"
    if code in (2, 3, 4) and "error" not in err:  # a message, not a silent failure
        return f"plan {' '.join(map(repr, argv))} -> exit {code} without a message"
    return None


# --- the real profile, computed once per model and options ----------------------------

@pytest.fixture
def _cached_profiles(monkeypatch):
    real = cli._profile
    cache: dict = {}

    def profile_once(args, batch_size, status, progress):
        key = (args.model, batch_size, args.precision, args.optimizer)
        if key not in cache:
            try:
                cache[key] = ("ok", real(args, batch_size, status, progress))
            except Exception as e:  # a typed error is as reproducible as a profile
                cache[key] = ("error", e)
        kind, value = cache[key]
        if kind == "error":
            raise value
        return value

    monkeypatch.setattr(cli, "_profile", profile_once)
    return cache


# --- random values ---------------------------------------------------------------------

NASTY_NUMBERS = ["0", "-1", "-8", "1", "2", "3", "7", "8", "64", "1000000000000", "1e12",
                 "10000000000000000000000", "99999999999999999999999999999999", "nan", "inf",
                 "-inf", "1.5", "0x10", "", " ", "eight", "2**10", "８", "1_000"]
NASTY_TEXT = ["", " ", "-", "--", "x", "dp=2", "dp=2,dp=4", "dp=0", "tp=3", "pp=9999",
              "dp=2,tp=2,pp=2", "dp=1,", ",", "=", "dp==2", "dp=2;pp=2", "DP=2", "pp=-1",
              "a" * 300, "\x00", "é", "cpu:0", "cpu:-1", "cpu:x", "0xcpu:1", "9xTPU-v9",
              "8xA100-80GB", "1000000x8xA100-80GB", "0x8xA100-80GB", "cpu:2", "2xcpu:1",
              "/nonexistent/c.yaml", "c.json", "adam", "adamz", "SGD", "ada m", "None"]
VALUE_MUTANTS = [None, -1, 0, 1, -1e308, 1e308, 10**30, "x", "", [], {}, True, False, [1, 2],
                 {"a": 1}, 0.5, -0.5, "NaN", 2**63, "8xA100-80GB"]


def _value(rng: random.Random, pool=None) -> str:
    pool = pool or (NASTY_NUMBERS + NASTY_TEXT)
    return rng.choice(pool)


def random_argv(rng: random.Random, tmp: str) -> list[str]:
    """A command line from random options and malformed values, built so that it never
    starts training processes or measures hardware (launch only with --emit or bad
    --workers; profile-hardware only with devices that do not exist)."""
    command = rng.choice(["analyze", "analyze", "analyze", "profile", "report", "clusters",
                          "launch", "profile-hardware", "", "analyse", "--version", "-h",
                          "nonsense"])
    argv = [command] if command else []
    model = rng.choice([MLP, MLP, os.path.join(tmp, "missing.py"), "keras.nothing:Nope",
                        "not-a-module", "", "examples", os.path.join(tmp, "bad.py"),
                        os.path.join(tmp, "cluster.json")])
    if command == "analyze":
        argv.append(model)
        if rng.random() < 0.9:
            argv += ["--cluster", _value(rng, NASTY_TEXT)]
        if rng.random() < 0.9:
            argv += ["--global-batch", _value(rng, NASTY_NUMBERS)]
        options = [("--fix", NASTY_TEXT), ("--microbatch-size", NASTY_NUMBERS),
                   ("--recompute", ["none", "full", "half", ""]),
                   ("--schedule", ["gpipe", "1f1b", "interleaved", "zigzag"]),
                   ("--virtual-stages", NASTY_NUMBERS), ("--layout", ["tp-dp-pp", "dp-tp"]),
                   ("--optimizer", NASTY_TEXT), ("--precision", ["float32", "float8", ""]),
                   ("--time-limit", NASTY_NUMBERS),
                   ("--measured", [os.path.join(tmp, "measured.json"), "/nonexistent.json",
                                   tmp])]
        for name, pool in rng.sample(options, rng.randint(0, 4)):
            argv += [name, rng.choice(pool)]
        if rng.random() < 0.3:
            argv.append("--optimizer-sharding")
        argv += ["--out", os.path.join(tmp, "out")] if rng.random() < 0.9 else \
            ["--out", rng.choice([os.path.join(tmp, "bad.py"),
                                     os.path.join(tmp, "bad.py", "sub")])]
        # the search itself only for small, valid-looking requests on the cheapest model
        if model == MLP and not _cheap_search(argv):
            argv[1] = os.path.join(tmp, "missing.py")
    elif command == "profile":
        argv.append(model if model != MLP or rng.random() < 0.3 else os.path.join(tmp, "x.py"))
        for name, pool in rng.sample([("--batch-size", NASTY_NUMBERS), ("--optimizer", NASTY_TEXT),
                                      ("--precision", ["float32", "float64"]),
                                      ("--steps", NASTY_NUMBERS)], rng.randint(0, 3)):
            argv += [name, rng.choice(pool)]
        if argv[1] == MLP and any(a in argv for a in ("--batch-size", "--steps")):
            argv[1] = os.path.join(tmp, "missing.py")  # keep profiles to the cached few
    elif command == "report":
        argv.append(rng.choice([tmp, os.path.join(tmp, "missing"), MLP, "",
                                os.path.join(tmp, "out")]))
        if rng.random() < 0.3:
            argv += ["--html", rng.choice([os.path.join(tmp, "r.html"), tmp,
                                           os.path.join(MLP, "x.html")])]
    elif command == "launch":
        argv += ["--workers", _value(rng, NASTY_NUMBERS)]
        argv += ["--emit", rng.choice(["tf-config", "tfjob", "yaml"])]
        for name, pool in rng.sample([("--hosts", ["a,b", "", ",", "h:1,h:2,h:3", "h:x"]),
                                      ("--port", NASTY_NUMBERS), ("--plan", NASTY_TEXT),
                                      ("--name", NASTY_TEXT)], rng.randint(0, 3)):
            argv += [name, rng.choice(pool)]
        if rng.random() < 0.5:
            argv.append(rng.choice(["examples/train.py", "missing.py", ""]))
    elif command == "profile-hardware":
        argv += ["--devices", rng.choice(["cpu:0", "cpu:00", "GPU:", "xyz:9", "GPU:7,GPU:8"])]
        argv += ["--quick"]
    if rng.random() < 0.3:
        argv.append("--json")
    if rng.random() < 0.05:
        argv.insert(rng.randrange(len(argv) + 1), _value(rng))
    return argv


def _cheap_search(argv: list[str]) -> bool:
    """Whether an analyze command line asks only for a small search (worth running)."""
    def arg(name):
        return argv[argv.index(name) + 1] if name in argv else None

    batch = arg("--global-batch")
    return (arg("--cluster") in ("cpu:2", "2xcpu:1", "8xA100-80GB")
            and batch is not None and batch.isdigit() and int(batch) <= 1000000000000
            and arg("--measured") is None)


# --- mutated documents ----------------------------------------------------------------------

def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:3]):
            yield from _paths(v, prefix + (i,))


def mutate(doc, rng: random.Random):
    """``doc`` with one to three random changes: a value replaced by one of another
    type or absurd size, a key deleted, an unknown key added, a list emptied."""
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            return rng.choice(VALUE_MUTANTS)
        path = rng.choice(paths)
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        action = rng.random()
        if action < 0.6:
            parent[key] = rng.choice(VALUE_MUTANTS)
        elif action < 0.8 and isinstance(parent, dict):
            del parent[key]
        elif isinstance(parent, dict):
            parent["unexpected_" + str(rng.randrange(100))] = rng.choice(VALUE_MUTANTS)
        elif isinstance(parent, list):
            parent.clear()
    return doc


def serialise(doc, rng: random.Random, yaml_form: bool = False) -> str:
    """JSON (or YAML) text of ``doc``, sometimes truncated or garbled."""
    if yaml_form:
        import yaml
        text = yaml.safe_dump(doc)
    else:
        text = json.dumps(doc, indent=1, allow_nan=True)
    r = rng.random()
    if r < 0.15:
        text = text[:rng.randrange(len(text) + 1)]
    elif r < 0.2:
        text = rng.choice(["", "{", "[]", "null", "42", "\"text\"", "{{{", ":\n- -", "\x00\x01",
                           "preset: 8xA100-80GB\nnodes: -3", "preset: 8xA100-80GB\nnodes: 1e30",
                           "preset: nope", "!!python/object:os.system {}", "a: [1, 2"])
    return text


def cluster_docs() -> list[dict]:
    return [parse_cluster(name).to_dict() for name in ("cpu:2", "8xA100-80GB", "2x8xH100-80GB",
                                                       "2xcpu:1")] + \
        [{"preset": "8xA100-80GB", "nodes": 2}]


# --- the test ---------------------------------------------------------------------------------

N_ARGV, N_SEARCH, N_CLUSTER, N_ANALYSIS, N_MEASURED = 300, 80, 150, 120, 30


@pytest.fixture
def analysis_dir(tmp_path, _cached_profiles):
    """A real analysis of examples/mlp.py (plan.json, profile.json, candidates.json)."""
    out = tmp_path / "good"
    code, _, err = run_case(["analyze", MLP, "--cluster", "cpu:2", "--global-batch", "16",
                             "--out", str(out)])
    assert code == 0, err
    return out


def test_fuzz_the_cli_never_shows_a_traceback(tmp_path, analysis_dir, _cached_profiles):
    rng = random.Random(SEED)
    tmp = str(tmp_path)
    (tmp_path / "bad.py").write_text("def build_model(:\n")
    (tmp_path / "measured.json").write_text('{"layers": 3, "step_time_s": "x"}')
    started = time.perf_counter()
    cases = 0
    failures: dict[str, str] = {}  # by the error's last line: one example of each bug
    exits: dict[tuple[str, int], int] = {}  # (command, exit code) -> cases

    def check(argv):
        nonlocal cases
        code, _, err = run_case(argv)
        cases += 1
        exits[(argv[0] if argv else "", code)] = exits.get((argv[0] if argv else "", code), 0) + 1
        found = problem(argv, code, err)
        if found:
            failures.setdefault(found.strip().splitlines()[-1], found)

    # 1. random and malformed command lines
    for _ in range(N_ARGV):
        check(random_argv(rng, tmp))

    # 1b. near-valid requests that reach the search (the cached profile of examples/mlp.py)
    for _ in range(N_SEARCH):
        argv = ["analyze", MLP, "--cluster", rng.choice(["cpu:2", "cpu:8", "2xcpu:1",
                                                          "8xA100-80GB", "2x8xA100-80GB"]),
                "--global-batch", rng.choice(["1", "2", "3", "8", "16", "48", "64", "1000"]),
                "--out", os.path.join(tmp, "out"), "--time-limit", "2"]
        options = [("--fix", ["dp=2", "pp=2", "tp=2", "dp=2,pp=2", "pp=3", "dp=8", "tp=8",
                              "dp=2,tp=2,pp=2", "pp=16"]),
                   ("--microbatch-size", ["1", "2", "4", "3", "16", "4096"]),
                   ("--recompute", ["none", "selective", "full"]),
                   ("--schedule", ["gpipe", "1f1b", "interleaved"]),
                   ("--virtual-stages", ["1", "2", "3", "4"]),
                   ("--layout", ["tp-dp-pp", "tp-pp-dp"]),
                   ("--optimizer", ["sgd", "adafactor", "muon", "adamz"])]
        for name, pool in rng.sample(options, rng.randint(0, 3)):
            argv += [name, rng.choice(pool)]
        if rng.random() < 0.2:
            argv.append("--optimizer-sharding")
        if rng.random() < 0.5:
            argv.append("--json")
        check(argv)

    # 2. cluster files: garbage, wrong types, missing fields, huge and negative numbers
    docs = cluster_docs()
    for i in range(N_CLUSTER):
        yaml_form = rng.random() < 0.4
        path = tmp_path / f"cluster{i}.{'yaml' if yaml_form else 'json'}"
        path.write_text(serialise(mutate(rng.choice(docs), rng), rng, yaml_form))
        # most stop at the cluster; a few valid-looking ones go on to the search
        model = MLP if rng.random() < 0.15 else os.path.join(tmp, "missing.py")
        check(["analyze", model, "--cluster", str(path), "--global-batch",
               rng.choice(["8", "16", "64"]), "--out", os.path.join(tmp, "out")])

    # 3. analysis directories and plan files: truncated, wrong schema_version, wrong types
    files = {name: json.loads((analysis_dir / name).read_text())
             for name in ("plan.json", "profile.json", "candidates.json")}
    for i in range(N_ANALYSIS):
        d = tmp_path / f"analysis{i}"
        d.mkdir()
        for name, doc in files.items():
            (d / name).write_text(json.dumps(doc))
        victim = rng.choice(list(files))
        r = rng.random()
        if r < 0.1:
            (d / victim).unlink()
        elif r < 0.25:
            bad = copy.deepcopy(files[victim])
            target = bad[0] if isinstance(bad, list) and bad else bad
            if isinstance(target, dict):
                target["schema_version"] = rng.choice([999, 0, "1", None, -1, 1.5])
            (d / victim).write_text(json.dumps(bad))
        else:
            (d / victim).write_text(serialise(mutate(files[victim], rng), rng))
        extra = rng.choice([[], ["--json"], ["--html", str(d / "r.html")]])
        check(["report", str(d), *extra])
        if victim == "plan.json" and rng.random() < 0.3:  # plan files given to launch
            check(["launch", "--workers", "2", "--emit", rng.choice(["tf-config", "tfjob"]),
                   "--plan", str(d / "plan.json")])

    # 4. --measured files (read before profiling)
    for i in range(N_MEASURED):
        path = tmp_path / f"measured{i}.json"
        path.write_text(serialise(mutate({"measured": {"layers": [{"name": "dense_1"}],
                                                       "step_time_s": 0.01}}, rng), rng))
        check(["analyze", os.path.join(tmp, "missing.py"), "--cluster", "cpu:2",
               "--global-batch", "8", "--measured", str(path)])

    elapsed = time.perf_counter() - started
    print(f"{cases} fuzz cases in {elapsed:.1f} s; (command, exit): cases {sorted(exits.items())}")
    assert not failures, f"{len(failures)} kinds of traceback or hang:\n\n" + \
        "\n\n".join(failures.values())
    assert cases >= 500
