"""planner.traffic: the bytes each device sends per step, by kind, worked by hand on a
chain of Dense layers (tests.planner.test_search.chain_profile: 1000 params, 4-byte
gradients, 32 KiB activations per 8 samples), and carried in plan.json."""
from __future__ import annotations

import dataclasses
import json

from tfplan.planner.plan import Plan, Strategy
from tfplan.planner.search import search
from tfplan.planner.traffic import KINDS, sent_bytes_per_device, total_by_kind
from tests.planner.test_search import chain_profile, make_cluster

DEV = [f"/device:GPU:{i}" for i in range(8)]


def _sent(strategy, bounds, splits=None, devices=None, n_layers=4):
    p = chain_profile(n_layers=n_layers, params=1000)
    devices = devices or [DEV[:strategy.dp * strategy.tp]] * len(bounds)
    out = sent_bytes_per_device(p, strategy, bounds, splits or ("",) * n_layers, devices)
    return {d: dict(k) for d, k in out}


def test_data_parallel_sends_the_ring_all_reduce_of_every_gradient():
    # G = 4 layers x 4000 bytes; ring: 2 (4-1)/4 G = 24000 bytes per device
    sent = _sent(Strategy(dp=4, tp=1, pp=1, microbatch_size=2, num_microbatches=1), [(0, 4)])
    assert set(sent) == set(DEV[:4])
    for d in DEV[:4]:
        assert sent[d] == {**dict.fromkeys(KINDS, 0), "dp": 24000}


def test_pipeline_boundary_sends_the_activation_forward_and_its_gradient_back():
    # m=4 micro-batches of 2 of the profile's 8 samples: N = 32768 / 4 = 8192 per micro-batch
    s = Strategy(dp=1, tp=1, pp=2, microbatch_size=2, num_microbatches=4, schedule="gpipe")
    sent = _sent(s, [(0, 2), (2, 4)], devices=[DEV[:1], DEV[1:2]])
    assert sent[DEV[0]]["pp"] == sent[DEV[1]]["pp"] == 4 * 8192
    # three stages: the middle one is on two boundaries
    s3 = Strategy(dp=1, tp=1, pp=3, microbatch_size=8, num_microbatches=1, schedule="gpipe")
    sent = _sent(s3, [(0, 1), (1, 3), (3, 4)], devices=[DEV[:1], DEV[1:2], DEV[2:3]])
    assert [sent[d]["pp"] for d in DEV[:3]] == [32768, 65536, 32768]


def test_tensor_parallel_sends_the_f_and_g_all_reduces():
    # d0 column: its input's gradient (the 4096-byte model input) all-reduced backward;
    # d1 row: its 32768-byte output all-reduced forward; tp=2: 2 (1/2) N each
    s = Strategy(dp=1, tp=2, pp=1, microbatch_size=8, num_microbatches=1)
    sent = _sent(s, [(0, 2)], splits=("column", "row"), n_layers=2)
    assert sent[DEV[0]]["tp"] == sent[DEV[1]]["tp"] == 4096 + 32768
    full = Strategy(dp=1, tp=2, pp=1, microbatch_size=8, num_microbatches=1, recompute="full")
    sent = _sent(full, [(0, 2)], splits=("column", "row"), n_layers=2)
    assert sent[DEV[0]]["tp"] == 4096 + 2 * 32768  # the forward's all-reduce runs again
    # dp=2 x tp=2: each rank's gradients are its 1/tp shard: 2 x 2000 bytes, ring over 2
    s = Strategy(dp=2, tp=2, pp=1, microbatch_size=4, num_microbatches=1)
    sent = _sent(s, [(0, 2)], splits=("column", "row"), n_layers=2)
    assert sent[DEV[0]] == {**dict.fromkeys(KINDS, 0), "tp": (4096 + 32768) // 2, "dp": 4000}


def test_a_column_split_no_row_split_reads_all_gathers_its_output():
    # "column" then unsplit layers: the 32768-byte output is all-gathered, (tp-1)/tp of it
    # sent per device, beside its input gradient's backward all-reduce (4096 bytes)
    s = Strategy(dp=1, tp=2, pp=1, microbatch_size=8, num_microbatches=1)
    sent = _sent(s, [(0, 2)], splits=("column", ""), n_layers=2)
    assert sent[DEV[0]]["tp"] == 4096 + 32768 // 2
    full = dataclasses.replace(s, recompute="full")  # the forward's gather runs again
    # ZeRO-3 re-runs each layer's forward (apply.spmd.zero3): its collectives too
    zero3 = Strategy(dp=2, tp=2, pp=1, microbatch_size=4, num_microbatches=1, zero_stage=3)
    assert _sent(zero3, [(0, 2)], splits=("column", "row"), n_layers=2)[DEV[0]]["tp"] == \
        (4096 + 2 * 32768) // 2
    assert _sent(full, [(0, 2)], splits=("column", ""), n_layers=2)[DEV[0]]["tp"] == \
        4096 + 32768


def test_zero_stages_split_the_reduction_and_add_the_gathers():
    base = dict(dp=4, tp=1, pp=1, microbatch_size=1, num_microbatches=2)
    g = 16000  # gradient bytes; params 4 bytes each too
    one = _sent(Strategy(**base, zero_stage=1), [(0, 4)])[DEV[0]]
    assert (one["dp"], one["zero"]) == (3 * g // 4, 3 * g // 4)
    two = _sent(Strategy(**base, zero_stage=2), [(0, 4)])[DEV[0]]
    assert (two["dp"], two["zero"]) == (2 * 3 * g // 4, 3 * g // 4)  # reduce per micro-batch
    three = _sent(Strategy(**base, zero_stage=3), [(0, 4)])[DEV[0]]
    assert (three["dp"], three["zero"]) == (2 * 3 * g // 4, 2 * 2 * 3 * g // 4)


def test_every_searched_plan_lists_its_devices_and_round_trips_in_plan_json():
    profile = chain_profile()
    result = search(profile, make_cluster(), 32)
    for plan in result.candidates:
        if plan.placement != "stages":
            continue
        sent = dict(plan.predicted.sent_bytes_per_device)
        assert set(sent) == set(plan.devices), plan.name
        assert all(tuple(k for k, _ in kinds) == KINDS for kinds in sent.values())
        totals = total_by_kind(plan.predicted.sent_bytes_per_device)
        s = plan.strategy
        assert (totals["dp"] > 0) == (s.dp > 1), plan.name
        assert (totals["pp"] > 0) == (s.pp > 1), plan.name
        again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
        assert again.predicted.sent_bytes_per_device == plan.predicted.sent_bytes_per_device


def test_zero_gathers_an_embeddings_rows_and_then_its_updated_weights():
    # layer d0 an Embedding of 1000 float32 params (width 8): the profile batch's 32768
    # output bytes are 8192 elements = 1024 tokens; rows 4 x 8192 + ids 4 x 1024 bytes,
    # a quarter per replica (micro-batch 2 of 8); layer d1 dense, 4000 gradient bytes
    p = chain_profile(n_layers=2, params=1000)
    emb = dataclasses.replace(p.layers[0], type="Embedding", output_shape=(None, 4, 8))
    p = dataclasses.replace(p, layers=(emb, p.layers[1]))
    rows = 4 * 8192 + 4 * 1024
    for stage in (0, 1, 2, 3):
        s = Strategy(dp=4, tp=1, pp=1, microbatch_size=2, num_microbatches=1, zero_stage=stage)
        sent = dict(dict(sent_bytes_per_device(p, s, [(0, 2)], ("", ""), [DEV[:4]]))[DEV[0]])
        dense = {0: 2 * 3 * 4000 // 4, 1: 3 * 4000 // 4, 2: 3 * 4000 // 4,
                 3: 3 * 4000 // 4}[stage]
        assert sent["dp"] == round(3 * rows / 4) + dense  # x each replica's rows
        # ZeRO-1/2: d1's shards (priced at G = P here) and the Embedding's, all-gathered;
        # ZeRO-3: d1 gathered for its forward and backward, the table for the lookup only
        gathers = {0: 0, 1: 2 * (3 * 4000 // 4), 2: 2 * (3 * 4000 // 4),
                   3: 2 * (3 * 4000 // 4) + 3 * 4000 // 4}
        assert sent["zero"] == gathers[stage]


def test_batch_statistics_add_their_all_reduces_under_global():
    # d0 a BatchNormalization of C = 8 channels: 5 all-reduces of 32 bytes, 2 (3/4) each,
    # under global; local averages the 2 C = 16 moving values once: one of 64 bytes
    p = chain_profile(n_layers=2, params=1000)
    norm = dataclasses.replace(p.layers[0], type="BatchNormalization", output_shape=(None, 8))
    p = dataclasses.replace(p, layers=(norm, p.layers[1]))
    base = dict(dp=4, tp=1, pp=1, microbatch_size=2, num_microbatches=1)
    sent = {mode: dict(dict(sent_bytes_per_device(
        p, Strategy(**base, batch_norm=mode), [(0, 2)], ("", ""), [DEV[:4]]))[DEV[0]])
        for mode in ("global", "local")}
    assert sent["global"]["dp"] - sent["local"]["dp"] == (5 * 32 - 64) * 2 * 3 // 4
