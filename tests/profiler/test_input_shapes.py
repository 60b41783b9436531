"""Shapes the user states for a model's dynamic input dimensions (``profiler.input_shapes``).

A model with a ``(None, None)`` input profiled with ``input_shapes`` counts exactly what
the same model with a fixed ``keras.Input`` counts; a model file's ``sample_batch`` fills
what is not given (with a warning); every wrong shape is a PlannerError that says what
was received, what the model has and how to fix it.
"""
from __future__ import annotations

import textwrap

import keras
import pytest

from tfplan.core.errors import PlannerError
from tfplan.profiler.loader import load_model_source
from tfplan.profiler.model_profile import ModelProfile
from tfplan.profiler.static import profile_model, profile_source

SEQ, VOCAB, BATCH = 16, 50, 2
COUNTED = ("params", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes",
           "activation_saved_bytes", "input_bytes", "flops_fwd", "flops_bwd",
           "matmul_flops_fwd", "matmul_flops_bwd", "memory_traffic_bytes_fwd",
           "memory_traffic_bytes_bwd")


def tiny(seq: int | None) -> keras.Model:
    """token_ids (batch, seq) int -> Embedding -> Dense -> Dense; names fixed."""
    tokens = keras.Input(shape=(seq,), dtype="int32", name="token_ids")
    h = keras.layers.Embedding(VOCAB, 8, name="embed")(tokens)
    h = keras.layers.Dense(12, activation="relu", name="hidden")(h)
    out = keras.layers.Dense(VOCAB, name="logits")(h)
    return keras.Model(tokens, out, name="tiny_lm")


def two_inputs() -> keras.Model:
    """token_ids (None,), features (None, 3): one dynamic dim each, one fixed dim."""
    tokens = keras.Input(shape=(None,), dtype="int32", name="token_ids")
    feats = keras.Input(shape=(None, 3), name="features")
    h = keras.layers.Embedding(VOCAB, 3, name="embed")(tokens)
    h = keras.layers.Add(name="add")([h, feats])
    out = keras.layers.Dense(4, name="head")(h)
    return keras.Model({"token_ids": tokens, "features": feats}, out, name="two_in")


def _numbers(profile: ModelProfile) -> list[tuple]:
    return [(l.name, l.type) + tuple(getattr(l, k) for k in COUNTED) for l in profile.layers]


# --- input_shapes: the same numbers as a fixed keras.Input -------------------------------

def test_input_shapes_count_exactly_what_a_fixed_input_counts():
    fixed = profile_model(tiny(SEQ), BATCH, optimizer="adam")
    dynamic = profile_model(tiny(None), BATCH, optimizer="adam",
                            input_shapes={"token_ids": (SEQ,)})
    assert _numbers(dynamic) == _numbers(fixed)
    assert [(e.src, e.dst, e.bytes) for e in dynamic.edges] == \
        [(e.src, e.dst, e.bytes) for e in fixed.edges]
    assert dynamic.flops_fwd == fixed.flops_fwd > 0
    assert dynamic.flops_bwd == fixed.flops_bwd > 0
    # hand count of the matmuls: 2 FLOPs per multiply-add over BATCH * SEQ tokens
    assert dynamic.layer("logits").matmul_flops_fwd == 2 * BATCH * SEQ * 12 * VOCAB
    assert dynamic.input_shapes == (("token_ids", (SEQ,)),) == fixed.input_shapes
    # what the model leaves open stays open in the layers' recorded shapes
    assert dynamic.layer("logits").output_shape == (None, VOCAB)


def test_wildcard_fills_every_dynamic_input_of_its_rank():
    model = tiny(None)
    assert profile_model(model, BATCH, input_shapes={"*": (SEQ,)}).input_shapes == \
        (("token_ids", (SEQ,)),)
    two = profile_model(two_inputs(), BATCH,
                        input_shapes={"*": (SEQ,), "features": (SEQ, 3)})
    assert dict(two.input_shapes) == {"token_ids": (SEQ,), "features": (SEQ, 3)}


def test_input_shapes_round_trip_and_old_profiles_load():
    p = profile_model(tiny(None), BATCH, input_shapes={"token_ids": (SEQ,)})
    doc = p.to_dict()
    assert doc["input_shapes"] == {"token_ids": [SEQ]}
    assert ModelProfile.from_dict(doc).input_shapes == p.input_shapes
    del doc["input_shapes"]  # a profile written before input shapes were recorded
    assert ModelProfile.from_dict(doc).input_shapes == ()


# --- sample_batch fills what is not given ------------------------------------------------

MODEL_FILE = """
import keras
import numpy as np

def build_model():
    tokens = keras.Input(shape=(None,), dtype="int32", name="token_ids")
    feats = keras.Input(shape=(None, 3), name="features")
    h = keras.layers.Embedding(50, 3, name="embed")(tokens)
    h = keras.layers.Add(name="add")([h, feats])
    out = keras.layers.Dense(4, name="head")(h)
    return keras.Model({{"token_ids": tokens, "features": feats}}, out, name="two_in")

def sample_batch(batch_size):
    x = {x}
    return x, np.zeros((batch_size, {seq}, 4), "float32")
"""
DICT_X = ('{"features": np.zeros((batch_size, 7, 3), "float32"), '
          '"token_ids": np.zeros((batch_size, 7), "int32")}')
LIST_X = ('[np.zeros((batch_size, 7, 3), "float32"), '  # flattened order: features, token_ids
          'np.zeros((batch_size, 7), "int32")]')


def _source(tmp_path, x: str, seq: int = 7):
    path = tmp_path / "two_in.py"
    path.write_text(MODEL_FILE.format(x=x, seq=seq))
    return load_model_source(str(path))


@pytest.mark.parametrize("x", [DICT_X, LIST_X], ids=["dict-by-name", "list-by-position"])
def test_sample_batch_fills_dynamic_inputs_with_a_warning(tmp_path, x):
    profile = profile_source(_source(tmp_path, x), BATCH)
    assert dict(profile.input_shapes) == {"token_ids": (7,), "features": (7, 3)}
    note = [w for w in profile.warnings if "sample_batch" in w]
    assert len(note) == 1
    assert "token_ids (batch, 7)" in note[0] and "features (batch, 7, 3)" in note[0]
    assert "--input-shape" in note[0]


def test_given_shapes_win_over_sample_batch(tmp_path):
    profile = profile_source(_source(tmp_path, DICT_X), BATCH,
                             input_shapes={"token_ids": (5,), "features": (5, 3)})
    assert dict(profile.input_shapes) == {"token_ids": (5,), "features": (5, 3)}
    assert not [w for w in profile.warnings if "sample_batch" in w]
    mixed = profile_source(_source(tmp_path, DICT_X), BATCH, input_shapes={"features": (7, 3)})
    assert dict(mixed.input_shapes) == {"token_ids": (7,), "features": (7, 3)}
    note = [w for w in mixed.warnings if "sample_batch" in w]
    assert len(note) == 1 and "token_ids (batch, 7)" in note[0] and "features" not in note[0]


def test_sample_batch_that_contradicts_the_model_is_named(tmp_path):
    x = ('{"features": np.zeros((batch_size, 7, 5), "float32"), '
         '"token_ids": np.zeros((batch_size, 7), "int32")}')
    with pytest.raises(PlannerError, match=r"sample_batch\(1\)\[0\] for input 'features'.*"
                                           r"fixes it to 3"):
        profile_source(_source(tmp_path, x), BATCH)


def test_no_shape_and_no_sample_batch_says_which_flag_to_add(tmp_path):
    path = tmp_path / "lm.py"
    path.write_text(textwrap.dedent("""
        import keras
        def build_model():
            t = keras.Input(shape=(None,), dtype="int32", name="token_ids")
            return keras.Model(t, keras.layers.Embedding(10, 4, name="embed")(t))
    """))
    with pytest.raises(PlannerError) as e:
        profile_source(load_model_source(str(path)), BATCH)
    msg = str(e.value)
    assert "'token_ids' has shape (None, None)" in msg
    assert "--input-shape token_ids=N" in msg and "sample_batch" in msg


# --- errors ------------------------------------------------------------------------------

@pytest.mark.parametrize("shapes, needles", [
    ({"tokens": (SEQ,)}, ["'tokens'", "does not have", "token_ids (batch, None)",
                          "features (batch, None, 3)"]),
    ({"token_ids": (SEQ, 2), "features": (SEQ, 3)},
     ["2 dimension(s)", "'token_ids' has shape (batch, None)", "--input-shape token_ids=N"]),
    ({"token_ids": (SEQ,), "features": (SEQ, 4)},
     ["dimension 2 of input 'features' to 4", "fixes it to 3", "features=16,3"]),
    ({"token_ids": (0,), "features": (SEQ, 3)}, ["(0,)", "whole numbers >= 1"]),
    ({"token_ids": (-3,), "features": (SEQ, 3)}, ["(-3,)", "whole numbers >= 1"]),
    ({"token_ids": (SEQ,)}, ["'features' has shape (None, None, 3)",
                             "--input-shape features=N,3"]),
    ({"*": (SEQ, 5, 5)}, ["matches no input", "rank is 3"]),
], ids=["unknown-name", "wrong-rank", "contradicts-fixed", "zero", "negative", "left-unset",
        "wildcard-matches-nothing"])
def test_bad_input_shapes_are_refused_with_the_fix(shapes, needles):
    with pytest.raises(PlannerError) as e:
        profile_model(two_inputs(), BATCH, input_shapes=shapes)
    for needle in needles:
        assert needle in str(e.value), str(e.value)


def test_input_shapes_for_a_model_without_symbolic_inputs_is_refused():
    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    model = Sub()
    model(keras.ops.zeros((1, 3)))
    with pytest.raises(PlannerError, match="no symbolic inputs"):
        profile_model(model, BATCH, input_example=keras.ops.zeros((1, 3)),
                      input_shapes={"input": (3,)})
