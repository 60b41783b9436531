"""`plan analyze` says what its numbers leave out and refuses what it cannot honour:
the profile's warnings and uncounted ops in text and --json, unknown optimizers,
repeated --fix keys, a micro-batch larger than the batch, absurd global batches.

In-process (``tests.cli.test_fuzz.run_case``) on examples/mlp.py and a tiny model
with an op that has no FLOP formula (MatrixDeterminant).
"""
from __future__ import annotations

import json
import os
import time

import pytest

from tests.cli.test_fuzz import MLP, run_case

DET_MODEL = '''
import keras
import tensorflow as tf


class Det(keras.layers.Layer):
    def call(self, x):
        return tf.linalg.det(x)[..., None] * x[..., 0, :]


def build_model():
    inp = keras.Input((3, 3))
    x = keras.layers.Dense(3, name="d")(inp)
    return keras.Model(inp, Det(name="det")(x))
'''


def analyze(tmp_path, *args):
    return run_case(["analyze", *args, "--out", str(tmp_path / "out")])


def test_analyze_shows_the_profiles_warnings_and_uncounted_ops(tmp_path):
    model = tmp_path / "det_model.py"
    model.write_text(DET_MODEL)
    code, out, err = analyze(tmp_path, str(model), "--cluster", "cpu:2", "--global-batch", "8",
                             "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert any("MatrixDeterminant" in n and n.startswith("det: ") for n in doc["not_counted"])
    # the model is not compiled and names no optimizer: the profile says Adam was assumed
    assert any("assuming adam" in w for w in doc["warnings"])
    code, out, err = analyze(tmp_path, str(model), "--cluster", "cpu:2", "--global-batch", "8")
    assert code == 0, err
    assert "Warnings:" in out and "assuming adam" in out
    block = out[out.index("Not counted"):]
    assert "(MatrixDeterminant)" in block.splitlines()[1]


@pytest.mark.parametrize("command", ["analyze", "profile"])
def test_unknown_optimizer_is_an_error_listing_the_known_ones(tmp_path, command):
    extra = ["--cluster", "cpu:2", "--global-batch", "8", "--out", str(tmp_path)] \
        if command == "analyze" else []
    # a model that does not exist: the optimizer is refused before any loading or profiling
    code, _, err = run_case([command, str(tmp_path / "missing.py"), *extra,
                             "--optimizer", "adamz"])
    assert code == 2
    assert "optimizer 'adamz' is not one the profiler knows" in err
    assert "adam, adamax, adamw" in err and "sgd" in err


def test_repeated_fix_key_is_an_error_naming_it(tmp_path):
    code, _, err = analyze(tmp_path, MLP, "--cluster", "cpu:4", "--global-batch", "64",
                           "--fix", "dp=2,dp=4")
    assert code == 2 and "gives dp twice (dp=2 and dp=4)" in err


@pytest.mark.parametrize("extra, needle", [
    ((), "micro-batch size 128 does not divide the global batch 64"),
    (("--fix", "dp=2"), "does not divide the batch per replica, 32 (global batch 64 / dp 2)")])
def test_microbatch_larger_than_the_batch_is_a_typed_error_before_profiling(tmp_path, extra,
                                                                              needle):
    started = time.perf_counter()
    code, _, err = analyze(tmp_path, str(tmp_path / "missing.py"), "--cluster", "cpu:2",
                           "--global-batch", "64", "--microbatch-size", "128", *extra)
    assert code == 2 and needle in err and "Traceback" not in err
    assert "[1, 2, 4, 8, 16, 32" in err  # the sizes that would work
    assert time.perf_counter() - started < 5  # no model was loaded


def test_absurd_global_batch_gets_a_warning(tmp_path):
    code, out, err = analyze(tmp_path, MLP, "--cluster", "cpu:2", "--global-batch",
                             str(10**12), "--json")
    assert code == 0, err
    warnings = json.loads(out)["warnings"]
    assert any("is predicted to take" in w and "days" in w for w in warnings), warnings
    assert any("micro-batches" in w for w in warnings), warnings
    code, out, err = analyze(tmp_path, MLP, "--cluster", "cpu:2", "--global-batch", "64",
                             "--json")
    assert code == 0 and not any("days" in w for w in json.loads(out)["warnings"])
    # past what the search can price at all: an argument error
    code, _, err = run_case(["analyze", MLP, "--cluster", "cpu:2", "--global-batch",
                             str(10**14)])
    assert code == 2 and "at most 1e+13" in err


def test_analyze_says_when_apply_cannot_train_the_chosen_plan(tmp_path):
    """A plan apply refuses (tensor parallel with the weights offloaded, fixed on purpose:
    with the optimizer state alone offloaded it runs) is named as such, with the reason,
    in the text and in --json's apply_refuses; a plan apply runs has none."""
    import json as _json
    import os as _os
    from tests.cli.helpers import run
    env = {"MOE_AUX": "0"}
    old = {k: _os.environ.get(k) for k in env}
    _os.environ.update(env)
    try:
        fixed = ["analyze", "examples/mlp.py", "--cluster", "1xcpu:2", "--global-batch", "8",
                 "--fix", "tp=2"]
        code, out, err = run([*fixed, "--offload", "optimizer+weights",
                              "--out", str(tmp_path / "a")])
        assert code == 0, err
        out = " ".join((out + err).split())
        assert "apply cannot train this plan yet" in out
        assert "offload='optimizer+weights' with tp=2" in out
        code, out, err = run([*fixed, "--offload", "optimizer", "--out", str(tmp_path / "b"),
                              "--json"])
        assert code == 0, err
        assert _json.loads(out[out.index("{"):])["apply_refuses"] == []
    finally:
        for k, v in old.items():
            if v is None:
                _os.environ.pop(k, None)
            else:
                _os.environ[k] = v
