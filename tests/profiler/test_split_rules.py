"""profiler.split_rules: the splits a layer's configuration rules out, recorded in its
profile (so the planner never offers them) and asked by the SPMD engine before it cuts a
layer -- one rule for both."""
from __future__ import annotations

from dataclasses import replace

import keras
import pytest

from tfplan.apply.spmd.rank_layers import split_problem
from tfplan.profiler.comm import layer_comm
from tfplan.profiler.model_profile import LayerProfile
from tfplan.profiler.split_rules import einsum_split_axis, refused_splits


def _built(layer, shape):
    layer.build(shape)
    return layer


def _lora():
    dense = _built(keras.layers.Dense(8), (None, 4))
    dense.enable_lora(2)
    return dense


CASES = {  # name: (layer, the splits it is offered and refused)
    "dense": (lambda: _built(keras.layers.Dense(8), (None, 4)), ()),
    "lora dense": (_lora, ("column", "row")),
    "einsum projection": (lambda: _built(keras.layers.EinsumDense(
        "bqm,muh->bquh", output_shape=(None, 2, 4)), (None, 3, 8)), ("column",)),
    "einsum dense": (lambda: _built(keras.layers.EinsumDense(
        "abc,cd->abd", output_shape=(None, 8)), (None, 3, 4)), ()),
    "channels-first conv": (lambda: _built(keras.layers.Conv2D(
        4, 3, data_format="channels_first"), (None, 2, 8, 8)), ("column", "row")),
    "grouped conv": (lambda: _built(keras.layers.Conv2D(4, 3, groups=2), (None, 8, 8, 2)),
                     ("column", "row")),
    "attention": (lambda: keras.layers.MultiHeadAttention(2, 4), ()),
    "attention over two axes": (lambda: keras.layers.MultiHeadAttention(
        2, 4, attention_axes=(1, 2)), ("heads",)),
    "embedding": (lambda: _built(keras.layers.Embedding(10, 4), (None, 3)), ()),
    "layer norm": (lambda: keras.layers.LayerNormalization(), ()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_refused_splits_are_the_ones_the_engine_refuses(name):
    make, refused = CASES[name]
    layer = make()
    assert refused_splits(layer) == refused
    if name in ("attention", "attention over two axes"):
        layer(keras.ops.zeros((1, 3, 8)), keras.ops.zeros((1, 3, 8)))  # built
    offered = {"attention": ("heads",), "attention over two axes": ("heads",),
               "embedding": ("vocab",), "layer norm": ()}.get(name, ("column", "row"))
    for split in offered:  # the engine refuses exactly these (at a degree that divides)
        assert bool(split_problem(layer, split, 1)) == (split in refused), split


def test_an_einsum_split_cuts_one_kernel_axis():
    assert einsum_split_axis("abc,cd->abd", "column") == ("d", "")
    assert einsum_split_axis("abc,cd->abd", "row") == ("c", "")
    char, why = einsum_split_axis("bqm,muh->bquh", "column")
    assert char == "" and "2 output kernel axes" in why
    assert einsum_split_axis("bquh,uhm->bqm", "row")[1]  # two contracted axes


def test_the_planner_is_offered_only_what_the_profile_allows_and_it_round_trips():
    layer = LayerProfile(name="q", type="EinsumDense", params=8, trainable_params=8,
                         param_bytes=32, grad_bytes=32, optimizer_bytes=64, activation_bytes=64,
                         flops_fwd=0, flops_bwd=0, refused_splits=("column",))
    assert [s.split for s in layer_comm(layer, 64).tp_splits] == ["row"]
    assert [s.split for s in layer_comm(replace(layer, refused_splits=()), 64).tp_splits] \
        == ["column", "row"]
    assert LayerProfile.from_dict(layer.to_dict()).refused_splits == ("column",)
    assert "refused_splits" not in replace(layer, refused_splits=()).to_dict()
