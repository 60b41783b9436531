"""Sequence parallelism, context parallelism and selective recomputation of the attention
core as planner.pricing prices them, and the search's knobs and micro-batch sizes."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tfplan.core.errors import PlannerError
from tfplan.core.presets import parse_cluster
from tfplan.planner.candidates import hybrid_choices
from tfplan.planner.context import search_context
from tfplan.planner.pricing import Pricer, full_recompute_memory
from tfplan.planner.search import search
from tfplan.planner.sequence import (sequence_length, sequence_parallel_layers,
                                     sequence_splits)
from tests.planner.gpt_profile import gpt_profile


def _fixed(profile, cluster, batch, **fix):
    return search(profile, parse_cluster(cluster), batch, fix=fix).chosen


def _with_shapes(profile, seq, hidden):
    """The hand-made profile records no output shapes; give every layer [seq, hidden]
    (the head's vocabulary width does not matter here)."""
    layers = tuple(dataclasses.replace(l, output_shape=(seq, hidden)) for l in profile.layers)
    return dataclasses.replace(profile, layers=layers)


def test_sequence_parallel_divides_the_replicated_layers_not_the_communication():
    profile = _with_shapes(gpt_profile(4, 4096, 32, vocab=51200, seq=2048), 2048, 4096)
    base = dict(dp=1, tp=8, microbatch_size=1, recompute="none")
    plain = _fixed(profile, "8xA100-80GB", 8, **base, sequence_parallel=False)
    sp = _fixed(profile, "8xA100-80GB", 8, **base, sequence_parallel=True)
    # Korthikanti et al. 2022, Sec. 4.2.2: all-gather + reduce-scatter = the all-reduce
    assert sp.predicted.breakdown.communication_s == pytest.approx(
        plain.predicted.breakdown.communication_s)
    assert sp.predicted.breakdown.compute_s < plain.predicted.breakdown.compute_s
    assert sp.predicted.max_memory_bytes < plain.predicted.max_memory_bytes
    # which layers: the norms and residual adds, not the split attention and MLP
    ctx = search_context(profile, parse_cluster("8xA100-80GB"), 8)
    splits = Pricer(ctx).splits_for(8)
    mask = dict(zip((l.name for l in profile.layers),
                    sequence_parallel_layers(profile, splits)))
    assert mask["ln1_0"] and mask["res1_0"] and mask["ln_f"]
    assert not mask["attn_0"] and not mask["fc_0"]
    # activations per layer: a LayerNorm's saved bytes shrink by tp
    pr = Pricer(ctx)
    i = [l.name for l in profile.layers].index("ln1_0")
    assert pr.arrays(8, 1, True)["act"][i] == pytest.approx(pr.arrays(8, 1, False)["act"][i] / 8)


def test_sequence_parallel_needs_tp():
    profile = gpt_profile(2, 1024, 16, vocab=8192, seq=512)
    with pytest.raises(PlannerError, match="needs tp > 1"):
        _fixed(profile, "8xA100-80GB", 8, dp=8, sequence_parallel=True)


def test_sequence_parallel_needs_a_sequence_that_divides_by_tp():
    """apply cuts the sequence into tp equal pieces (its reduce-scatter): a length that
    does not divide, or an unknown one, is never offered and refused when fixed."""
    profile = _with_shapes(gpt_profile(2, 1024, 16, vocab=8192, seq=510), 510, 1024)
    assert sequence_splits(profile, 2) and not sequence_splits(profile, 4)
    assert not sequence_splits(gpt_profile(2, 1024, 16, vocab=8192, seq=512), 2)  # no shapes
    with pytest.raises(PlannerError, match=r"sequence parallelism with tp=4.*divides by 4"):
        _fixed(profile, "8xA100-80GB", 8, dp=2, tp=4, sequence_parallel=True)
    ctx = search_context(profile, parse_cluster("8xA100-80GB"), 8)
    offered = {(c.tp, c.sequence_parallel) for c in hybrid_choices(ctx, {}, skip_classic=False)}
    assert (2, True) in offered and (4, True) not in offered and (4, False) in offered


def test_context_parallel_splits_the_sequence_and_exchanges_keys_and_values():
    profile = gpt_profile(4, 4096, 32, vocab=51200, seq=32768)
    assert sequence_length(profile) is None  # the hand-made profile records no shapes
    profile = _with_shapes(profile, 32768, 4096)
    assert sequence_length(profile) == 32768
    one = _fixed(profile, "8xA100-80GB", 1, cp=1, tp=8, microbatch_size=1, recompute="none")
    two = _fixed(profile, "2x8xA100-80GB", 1, cp=2, tp=8, microbatch_size=1, recompute="none")
    assert two.strategy.cp == 2 and len(two.stages[0].devices) == 16
    # activations divide by cp; the weights' state does not
    assert two.predicted.max_memory_bytes < 0.75 * one.predicted.max_memory_bytes
    assert two.predicted.breakdown.compute_s < 0.6 * one.predicted.breakdown.compute_s
    ctx = search_context(profile, parse_cluster("2x8xA100-80GB"), 1)
    pr = Pricer(ctx)
    attn = [l.name for l in profile.layers].index("attn_0")
    a1, a2 = pr.arrays(8, 1, False, 1), pr.arrays(8, 1, False, 2)
    # the other rank's keys and values are kept for the backward: half the K/V bytes
    kv = profile.layers[attn].attention_kv_bytes / 8
    assert a2["act"][attn] == pytest.approx(a1["act"][attn] / 2 + kv / 2)
    # the cp=2 search at 32k tokens considers cp
    choices = hybrid_choices(ctx, {}, skip_classic=True)
    assert {c.cp for c in choices} >= {1, 2}


def test_cp_that_does_not_split_the_sequence_is_refused():
    profile = _with_shapes(gpt_profile(2, 1024, 16, vocab=8192, seq=1000), 1000, 1024)
    with pytest.raises(PlannerError, match="does not split into 3"):
        _fixed(profile, "8xA100-80GB", 8, cp=3)


def test_selective_recomputes_the_attention_core_only():
    profile = gpt_profile(4, 4096, 32, vocab=51200, seq=2048)
    base = dict(dp=1, tp=8, microbatch_size=1, num_microbatches=8)
    none = _fixed(profile, "8xA100-80GB", 8, **base, recompute="none")
    sel = _fixed(profile, "8xA100-80GB", 8, **base, recompute="selective")
    full = _fixed(profile, "8xA100-80GB", 8, **base, recompute="full")
    # Korthikanti et al. 2022, Table 2 / Sec. 5: the core is a small share of the FLOPs
    core = sum(l.attention_core_flops_fwd for l in profile.layers)
    total = sum(l.flops_fwd + l.flops_bwd for l in profile.layers)
    assert sel.predicted.hardware_tflops_per_device == pytest.approx(
        sel.predicted.model_tflops_per_device * (total + core) / total, rel=1e-6)
    assert 0 < sel.predicted.breakdown.recompute_s < 0.3 * full.predicted.breakdown.recompute_s
    # and frees the 5 a s^2 b bytes of scores per layer
    assert full.predicted.max_memory_bytes < sel.predicted.max_memory_bytes \
        < none.predicted.max_memory_bytes


def test_full_recompute_memory_picks_the_best_checkpoint_spacing():
    inp = np.full(16, 1.0)
    act = np.full(16, 4.0)
    kept, working = full_recompute_memory(inp, act, 1)
    # every L layers: 16/L inputs kept + 4 L working; best at L = 2: 8 + 8
    assert (kept, working) == (8.0, 8.0)
    kept, working = full_recompute_memory(inp, act, 16)  # many micro-batches in flight:
    assert (kept, working) == (2.0, 32.0)  # 16 x 2 + 32 beats 16 x 4 + 16 and 16 x 1 + 64


def test_a_knob_restricts_only_what_it_names():
    profile = gpt_profile(2, 1024, 16, vocab=8192, seq=512)
    cluster = parse_cluster("8xA100-80GB")
    names = [p.name for p in search(profile, cluster, 64, fix={"recompute": "none"}).candidates]
    assert "single device" in names or any(n.startswith("data parallel") for n in names), names
    assert all("recompute=" not in n for n in names)


def test_microbatch_sizes_are_every_divisor_of_the_local_batch():
    profile = gpt_profile(2, 1024, 16, vocab=8192, seq=512)
    ctx = search_context(profile, parse_cluster("8xA100-80GB"), 8 * 48)
    sizes = {c.microbatch_size for c in hybrid_choices(ctx, {}, skip_classic=False,
                                                       shape=(8, 1, 1))}
    assert sizes == {1, 2, 3, 4, 6, 8, 12, 16, 24, 48}
