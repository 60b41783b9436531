"""examples/llama.py through the profiler, the tensor-parallel splits and ``plan analyze``.

Closed forms for its default sizes (b samples of s tokens, hidden h, n query heads and
k key/value heads of d = h / n, SwiGLU f, vocabulary V; float32, op_flops' rules):
RMSNormalization 4 b s h (Square, Mean, two Mul) + 3 b s (eps Add, Rsqrt); the
attention projections 2 b s h (n + 2 k + n) d, its core 4 b n s^2 d + 7 b n s^2 (scale,
causal mask, Softmax 5), + 2 (the repeats' sizes); gate 2 b s h f + 3 b s f (SiLU:
beta Mul, Sigmoid, Mul); up 2 b s h f; their product b s f; down 2 b s f h; each Add
b s h; the head 2 b s h V; the embedding's index check 2 b s.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import pytest
import tensorflow as tf

from tfplan.core.presets import parse_cluster
from tfplan.planner.tp_splits import solve_splits
from tfplan.profiler.loader import load_model_source
from tfplan.profiler.static import profile_source

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA = os.path.join(ROOT, "examples", "llama.py")
B, S, H, N, K, F, V, L = 2, 32, 64, 4, 2, 172, 256, 2  # the file's defaults
ENV = ("LLAMA_LAYERS", "LLAMA_HIDDEN", "LLAMA_HEADS", "LLAMA_KV_HEADS", "LLAMA_FFN",
       "LLAMA_VOCAB", "LLAMA_SEQ")


@pytest.fixture(scope="module")
def source():
    if any(name in os.environ for name in ENV):
        pytest.skip("LLAMA_* sizes set in the environment")
    return load_model_source(LLAMA)


@pytest.fixture(scope="module")
def profile(source):
    return profile_source(source, B)


def test_llama_profile_is_the_closed_form(source, profile):
    d = H // N
    with tf.Graph().as_default():
        model = source.build_model()
        params = {l.name: l.count_params() for l in model.layers if l.name != "tokens"}
    assert [l.name for l in profile.layers] == list(params)
    assert {l.name: l.params for l in profile.layers} == params
    assert profile.params == sum(params.values()) == \
        V * H + L * ((N + 2 * K + N) * d * H + 3 * H * F + 2 * H) + H + H * V
    core = 4 * B * N * S * S * d + 7 * B * N * S * S
    norm = 4 * B * S * H + 3 * B * S
    expected = {"tok_emb": 2 * B * S, "final_norm": norm, "lm_head": 2 * B * S * H * V}
    for i in range(L):
        expected.update({
            f"attn_norm_{i}": norm, f"mlp_norm_{i}": norm,
            f"attn_{i}": 2 * B * S * H * (N + 2 * K + N) * d + core + 2,
            f"attn_res_{i}": B * S * H, f"mlp_res_{i}": B * S * H,
            f"gate_{i}": 2 * B * S * H * F + 3 * B * S * F, f"up_{i}": 2 * B * S * H * F,
            f"swiglu_{i}": B * S * F, f"down_{i}": 2 * B * S * F * H})
    assert {l.name: l.flops_fwd for l in profile.layers} == expected
    assert profile.not_counted == () and profile.warnings == ()
    for i in range(L):
        attn = profile.layer(f"attn_{i}")
        assert attn.type == "GroupedQueryAttention" and attn.attention_kv_heads == K
        assert attn.attention_core_flops_fwd == core
        assert attn.attention_core_saved_bytes == 4 * B * N * S * S  # float32 softmax output
        assert attn.attention_kv_bytes == 2 * B * S * K * d * 4  # before the repeat to N heads


def test_heads_split_only_where_the_degree_divides_the_kv_heads(profile):
    cluster = parse_cluster("cpu:4")
    times = [1e-3] * len(profile.layers)
    attention = [i for i, l in enumerate(profile.layers) if l.type == "GroupedQueryAttention"]
    at = {tp: solve_splits(profile, cluster, tp, layer_time_s=times, samples=B)
          for tp in (2, 4)}
    assert [at[2].splits[i] for i in attention] == ["heads"] * L
    # 4 devices cannot share 2 key/value heads: no heads option, the layers stay whole
    assert [at[4].splits[i] for i in attention] == [""] * L
    options = {l.name: [o.split for o in l.options] for l in at[4].problem.layers}
    assert all(options[f"attn_{i}"] == ["replicate"] for i in range(L))
    assert "column" in options["gate_0"]  # the other layers still split at 4


def test_plan_analyze_offers_heads_splits_at_tp_2(tmp_path, source):
    env = {k: v for k, v in os.environ.items() if k not in ENV}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "tfplan.cli", "analyze", "examples/llama.py",
                        "--cluster", "cpu:4", "--global-batch", "8", "--json",
                        "--out", str(tmp_path / "out")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    by_tp: dict[int, list[dict]] = {}
    for c in doc["candidates"]:
        by_tp.setdefault(c["strategy"]["tp"], []).append(c.get("tp_splits", {}))
    assert by_tp.get(2), "no tp=2 candidate"
    for splits in by_tp[2]:
        assert [splits.get(f"attn_{i}") for i in range(L)] == ["heads"] * L
    for splits in by_tp.get(4, []):  # 2 key/value heads: never split over 4 devices
        assert not any(splits.get(f"attn_{i}") for i in range(L))
