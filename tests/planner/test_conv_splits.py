"""Convolutions under tensor parallelism: the planner may split Conv1D/2D/3D by column
(filters) or row (input channels), priced like Dense (profiler.comm, planner.tp_ilp),
and chooses to when it pays (planner.tp_splits on a real CNN profile)."""
from __future__ import annotations

import os

import pytest

from tfplan.planner.tp_ilp import split_options
from tfplan.planner.tp_splits import tp_split_rule
from tfplan.planner.validate import validate_plan
from tfplan.profiler.comm import layer_comm
from tfplan.profiler.model_profile import LayerProfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _conv(type_: str = "Conv2D") -> LayerProfile:
    """A 3x3 conv, 16 -> 32 channels, on an 8 x 8 image, batch 2, float32."""
    params = 3 * 3 * 16 * 32 + 32
    out = 2 * 8 * 8 * 32 * 4
    flops = 2 * 2 * 8 * 8 * 32 * 3 * 3 * 16
    return LayerProfile(name="conv", type=type_, params=params, trainable_params=params,
                        param_bytes=4 * params, grad_bytes=4 * params,
                        optimizer_bytes=8 * params, activation_bytes=out, flops_fwd=flops,
                        flops_bwd=2 * flops, input_bytes=2 * 8 * 8 * 16 * 4)


@pytest.mark.parametrize("type_", ["Conv1D", "Conv2D", "Conv3D"])
def test_conv_column_and_row_follow_megatron_f_and_g(type_):
    conv = _conv(type_)
    comm = layer_comm(conv, conv.input_bytes)
    splits = {s.split: (s.fwd_allreduce_bytes, s.bwd_allreduce_bytes) for s in comm.tp_splits}
    # column (filters): f, the input gradient all-reduced backward; the output stays cut
    # row (input channels): g, the partial outputs all-reduced forward
    assert splits == {"column": (0, 2 * 8 * 8 * 16 * 4), "row": (2 * 8 * 8 * 32 * 4, 0)}
    assert comm.dp_allreduce_bytes == 4 * (3 * 3 * 16 * 32 + 32)


@pytest.mark.parametrize("type_", ["DepthwiseConv2D", "SeparableConv2D", "Conv2DTranspose"])
def test_other_convolutions_stay_replicated(type_):
    assert layer_comm(_conv(type_), 100).tp_splits == ()


def test_a_split_conv_divides_compute_and_state_by_t():
    conv = _conv()
    options = {o.split: o for o in split_options(conv, conv.input_bytes, time_s=8.0,
                                                 state_bytes=1000.0, activation_bytes=400.0,
                                                 degree=4)}
    assert set(options) == {"replicate", "column", "row"}
    assert options["replicate"].compute_time_s == 8.0
    assert options["replicate"].memory_bytes == 1400.0
    assert options["column"].compute_time_s == options["row"].compute_time_s == 2.0
    assert options["column"].memory_bytes == 1000 / 4 + 400 / 4  # its output is cut too
    assert options["row"].memory_bytes == 1000 / 4 + 400
    assert [(c.kind, c.direction, c.nbytes) for c in options["column"].collectives] == [
        ("all-reduce", "backward", conv.input_bytes)]
    assert [(c.kind, c.direction, c.nbytes) for c in options["row"].collectives] == [
        ("all-reduce", "forward", conv.activation_bytes)]


def test_tp_split_rule_alternates_conv_pairs():
    types = ("Conv2D", "Conv2D", "Add", "MaxPooling2D", "Conv1D", "Conv1D", "Flatten", "Dense")
    assert tp_split_rule(types) == ("column", "row", "", "", "column", "row", "", "column")


def _cnn_profile():
    from tfplan.profiler.loader import load_model_source
    from tfplan.profiler.static import profile_source

    path = os.path.join(ROOT, "tests", "apply", "tiny_cnn.py")
    return profile_source(load_model_source(path), batch_size=1)


def test_planner_splits_the_cnn_convolutions_when_it_pays():
    from tfplan.core.presets import parse_cluster
    from tfplan.planner.search import search

    profile = _cnn_profile()
    cluster = parse_cluster("cpu:8")
    fix = {"tp": 2, "dp": 1, "pp": 1, "num_microbatches": 1}
    # 256 samples on one tensor-parallel pair: the convolutions' compute outweighs the
    # all-reduces of their 8 x 8 x 8 activations
    plan = search(profile, cluster, 256, fix=fix).chosen
    validate_plan(plan, profile)
    types = {l.name: l.type for l in profile.layers}
    splits = dict(plan.tp_splits)
    conv_splits = {name: split for name, split in splits.items() if types[name] == "Conv2D"}
    assert len(conv_splits) >= 2, plan.tp_splits
    assert "tp splits by ILP" in plan.solver
    # a column conv feeding a conv reads by rows: the Megatron pair, no gather between
    assert splits.get("res_a") == "column" and splits.get("res_b") == "row"
    # 16 samples: the collectives' latency outweighs half of a tiny conv; nothing split
    small = search(profile, cluster, 16, fix=fix).chosen
    assert not [n for n, _ in small.tp_splits if types[n] == "Conv2D"]


# --- grouped convolutions: apply.sharded_layers splits groups=1 only -----------------------
def _grouped(groups: int = 4) -> LayerProfile:
    import dataclasses

    return dataclasses.replace(_conv(), groups=groups)


def test_a_grouped_conv_is_offered_no_split():
    conv = _grouped()
    options = split_options(conv, conv.input_bytes, time_s=8.0, state_bytes=1000.0,
                            activation_bytes=400.0, degree=4)
    assert [o.split for o in options] == ["replicate"]
    ungrouped = split_options(_grouped(1), conv.input_bytes, time_s=8.0, state_bytes=1000.0,
                              activation_bytes=400.0, degree=4)
    assert [o.split for o in ungrouped] == ["replicate", "column", "row"]


def test_tp_split_rule_replicates_grouped_convs():
    types = ("Conv2D", "Conv2D", "Conv2D", "Dense")
    assert tp_split_rule(types, (1, 8, 1, 1)) == ("column", "", "row", "column")


def test_groups_round_trips_and_defaults_to_one():
    conv = _grouped(8)
    d = conv.to_dict()
    assert d["groups"] == 8 and LayerProfile.from_dict(d) == conv
    del d["groups"]  # a profile written before the field existed
    assert LayerProfile.from_dict(d).groups == 1


def test_planner_keeps_grouped_convolutions_replicated():
    import dataclasses

    from tfplan.core.presets import parse_cluster
    from tfplan.planner.search import search

    profile = _cnn_profile()
    convs = {l.name for l in profile.layers if l.type == "Conv2D"}
    grouped = dataclasses.replace(profile, layers=tuple(
        dataclasses.replace(l, groups=2) if l.name in convs else l for l in profile.layers))
    fix = {"tp": 2, "dp": 1, "pp": 1, "num_microbatches": 1}
    # at 256 samples the ungrouped convolutions are split (the test above)
    plan = search(grouped, parse_cluster("cpu:8"), 256, fix=fix).chosen
    validate_plan(plan, grouped)
    assert not [n for n, _ in plan.tp_splits if n in convs], plan.tp_splits
