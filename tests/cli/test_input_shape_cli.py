"""``--input-shape NAME=D1,...`` on ``plan analyze`` / ``plan profile``: a keras_hub GPT-2
backbone (inputs ``token_ids`` and ``padding_mask`` of shape (None, None)) is planned for
the stated sequence length, and the plan records it; bad flags are exit 2 with the fix.

In-process (``tfplan.cli.main``), as tests/cli/test_fuzz.py runs it: a subprocess would
import TensorFlow and keras_hub again for every case.
"""
from __future__ import annotations

import json
import textwrap

import pytest

from tests.cli.helpers import run

GPT2_FILE = textwrap.dedent("""
    import keras_hub

    def build_model():
        return keras_hub.models.GPT2Backbone(
            vocabulary_size=128, num_layers=2, num_heads=4, hidden_dim=32,
            intermediate_dim=64, max_sequence_length=64)
""")
FIXED_FILE = textwrap.dedent("""
    import keras

    def build_model():
        x = keras.Input(shape=(4,), name="features")
        return keras.Model(x, keras.layers.Dense(2, name="head")(x))
""")


@pytest.fixture(scope="module")
def gpt2_file(tmp_path_factory):
    pytest.importorskip("keras_hub")
    path = tmp_path_factory.mktemp("model") / "gpt2_tiny.py"
    path.write_text(GPT2_FILE)
    return str(path)


def analyze(model: str, out_dir, *flags: str) -> tuple[int, str, str]:
    return run(["analyze", model, "--cluster", "cpu:2", "--global-batch", "4",
                "--out", str(out_dir), "--json", *flags])


def test_analyze_plans_a_keras_hub_backbone_for_the_stated_shapes(gpt2_file, tmp_path):
    code, out, err = analyze(gpt2_file, tmp_path / "out", "--input-shape", "token_ids=16",
                             "--input-shape", "padding_mask=16")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["plan"]["model"]["input_shapes"] == {"padding_mask": [16], "token_ids": [16]}
    with open(tmp_path / "out" / "plan.json", encoding="utf-8") as f:
        assert json.load(f)["model"]["input_shapes"] == {"padding_mask": [16],
                                                          "token_ids": [16]}
    with open(tmp_path / "out" / "profile.json", encoding="utf-8") as f:
        assert json.load(f)["input_shapes"] == {"padding_mask": [16], "token_ids": [16]}


def test_profile_wildcard_counts_as_naming_every_input(gpt2_file):
    code, out, err = run(["profile", gpt2_file, "--batch-size", "2", "--json",
                          "--input-shape", "*=8"])
    assert code == 0, err
    wild = json.loads(out)
    code, out, err = run(["profile", gpt2_file, "--batch-size", "2", "--json",
                          "--input-shape", "token_ids=8", "--input-shape", "padding_mask=8"])
    assert code == 0, err
    named = json.loads(out)
    assert wild["input_shapes"] == named["input_shapes"] == {"padding_mask": [8],
                                                             "token_ids": [8]}
    assert wild["totals"] == named["totals"] and wild["totals"]["flops_fwd"] > 0


@pytest.mark.parametrize("flags, needles", [
    ([], ["padding_mask", "(None, None)", "--input-shape padding_mask=N"]),
    (["--input-shape", "token_ids=16"], ["padding_mask", "--input-shape padding_mask=N"]),
    (["--input-shape", "tokens=16", "--input-shape", "padding_mask=16"],
     ["'tokens'", "does not have", "token_ids (batch, None)", "padding_mask (batch, None)"]),
    (["--input-shape", "token_ids=16,2", "--input-shape", "padding_mask=16"],
     ["2 dimension(s)", "'token_ids'"]),
], ids=["none-given", "one-left-unset", "unknown-name", "wrong-rank"])
def test_shapes_that_do_not_fit_the_model_exit_2(gpt2_file, tmp_path, flags, needles):
    code, out, err = analyze(gpt2_file, tmp_path / "out", *flags)
    assert code == 2, (code, err)
    assert "error" in err and "Traceback" not in err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("flags, needles", [
    (["--input-shape", "token_ids=16", "--input-shape", "token_ids=8"],
     ["'token_ids' twice", "at most once"]),
    (["--input-shape", "token_ids=0"], ["below 1"]),
    (["--input-shape", "token_ids=-4"], ["below 1"]),
    (["--input-shape", "token_ids"], ["expected NAME=D1[,D2,...]"]),
    (["--input-shape", "token_ids=16,x"], ["expected NAME=D1[,D2,...]"]),
    (["--input-shape", "=16"], ["expected NAME=D1[,D2,...]"]),
], ids=["repeated", "zero", "negative", "no-dims", "not-a-number", "no-name"])
def test_malformed_flags_exit_2_before_the_model_is_loaded(tmp_path, flags, needles):
    missing = str(tmp_path / "does_not_exist.py")  # never loaded: the flag fails first
    for argv in (["analyze", missing, "--cluster", "cpu:2", "--global-batch", "4",
                  "--out", str(tmp_path / "out"), *flags],
                 ["profile", missing, *flags]):
        code, out, err = run(argv)
        assert code == 2, (argv, code, err)
        assert "does not exist" not in err, err
        for needle in needles:
            assert needle in err, err


def test_a_dim_that_contradicts_a_fixed_one_exits_2(tmp_path):
    path = tmp_path / "fixed.py"
    path.write_text(FIXED_FILE)
    code, out, err = run(["profile", str(path), "--input-shape", "features=5"])
    assert code == 2 and "fixes it to 4" in err, err
    code, out, err = run(["profile", str(path), "--input-shape", "features=4", "--json"])
    assert code == 0, err
    assert json.loads(out)["input_shapes"] == {"features": [4]}


def test_measure_refuses_a_sample_batch_of_other_shapes_before_measuring(tmp_path):
    path = tmp_path / "lm.py"
    path.write_text(textwrap.dedent("""
        import keras
        import numpy as np

        loss = "mse"

        def build_model():
            t = keras.Input(shape=(None,), dtype="int32", name="token_ids")
            return keras.Model(t, keras.layers.Embedding(10, 4, name="embed")(t))

        def sample_batch(batch_size):
            return np.zeros((batch_size, 8), "int32"), np.zeros((batch_size, 8, 4), "float32")
    """))
    code, out, err = run(["profile", str(path), "--measure", "--logdir", str(tmp_path / "log"),
                          "--input-shape", "token_ids=16"])
    assert code == 2, err
    assert "'token_ids' has shape (batch, 8)" in err and "(batch, 16)" in err, err
    assert not (tmp_path / "log" / "plugins").exists()  # nothing was measured
