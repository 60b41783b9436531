"""Benchmark: profile a 1e12-parameter GPT symbolically on this machine.

Pipeline position: outside the pipeline; it exercises ``profiler.static`` the
way ``plan profile`` does on a model far bigger than the machine (DESIGN.md:
built inside ``tf.Graph().as_default()``, no weights allocated).

The model is written with stock Keras layers only: token Embedding, then
``--layers`` pre-norm transformer blocks (LayerNormalization,
MultiHeadAttention with a causal mask, Add, LayerNormalization, Dense 4h gelu,
Dense h, Add), a final LayerNormalization and an untied Dense vocabulary head.
Defaults: 128 layers, hidden 25600, 160 heads, vocabulary 51200, sequence
2048 -- 1.009e12 parameters (GPT-3-style scaling to 1T).

Its 128 blocks are identical, so the profiler traces blocks 0-2 and copies the
rest (``profiler.repeats``; ``--no-repeats`` traces every block, which takes
minutes at this size). Printed: parameters, build time, profile time, peak
RSS (``resource.getrusage``), and forward FLOPs per token against the rule of
thumb 2*N' + 4*L*S*h, where N' is the parameter count without the input
embedding (a lookup, no multiply) and 4*L*S*h the attention scores and
context (Keras computes the full S x S product and masks it), and training
FLOPs per token against 6*N.

Run:  .venv/bin/python benchmarks/profile_gpt.py [--layers 128 --hidden 25600 ...]
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def build_gpt(layers: int, hidden: int, heads: int, vocab: int, seq: int,
              tap_after: int | None = None, join_after: int | None = None):
    """A GPT from stock Keras layers. ``tap_after``/``join_after`` (tests): a skip
    connection from after block i (-1: the embedding) added after block j."""
    import keras

    tokens = keras.Input((seq,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocab, hidden, name="wte")(tokens)
    tap = x
    for i in range(layers):
        y = keras.layers.LayerNormalization(name=f"ln1_{i}")(x)
        y = keras.layers.MultiHeadAttention(heads, hidden // heads, name=f"attn_{i}")(
            y, y, use_causal_mask=True)
        x = keras.layers.Add(name=f"res1_{i}")([x, y])
        y = keras.layers.LayerNormalization(name=f"ln2_{i}")(x)
        y = keras.layers.Dense(4 * hidden, activation="gelu", name=f"fc_{i}")(y)
        y = keras.layers.Dense(hidden, name=f"proj_{i}")(y)
        x = keras.layers.Add(name=f"res2_{i}")([x, y])
        if tap_after == i:
            tap = x
        if join_after == i:
            x = keras.layers.Add(name=f"skip_{i}")([x, tap])
    x = keras.layers.LayerNormalization(name="ln_f")(x)
    logits = keras.layers.Dense(vocab, use_bias=False, name="lm_head")(x)
    return keras.Model(tokens, logits, name="gpt")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=25600)
    parser.add_argument("--heads", type=int, default=160)
    parser.add_argument("--vocab", type=int, default=51200)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--no-repeats", action="store_true",
                        help="trace every block instead of one per role")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    from tfplan.profiler.tf_runtime import import_tensorflow

    tf = import_tensorflow()
    from tfplan.profiler.static import profile_model

    imported = time.perf_counter()
    with tf.Graph().as_default():
        model = build_gpt(args.layers, args.hidden, args.heads, args.vocab, args.seq)
        built = time.perf_counter()
        profile = profile_model(model, args.batch_size, optimizer="adam", name="gpt",
                                repeat_blocks=not args.no_repeats)
        profiled = time.perf_counter()
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB on Linux

    n = profile.params
    tokens = args.batch_size * args.seq
    n_matmul = n - model.get_layer("wte").count_params()
    attention = 4 * args.layers * args.seq * args.hidden
    fwd_per_token = profile.flops_fwd / tokens
    train_per_token = (profile.flops_fwd + profile.flops_bwd) / tokens
    print(f"params                    {n:,} ({n:.4g}); model.count_params() "
          f"{model.count_params():,}")
    print(f"import TensorFlow         {imported - start:6.1f} s")
    print(f"build (graph mode)        {built - imported:6.1f} s")
    print(f"profile                   {profiled - built:6.1f} s")
    print(f"total                     {profiled - start:6.1f} s")
    print(f"peak RSS                  {rss_gb:6.2f} GB")
    print(f"forward FLOPs per token   {fwd_per_token:.4e}")
    print(f"  2N' + 4LSh              {2 * n_matmul + attention:.4e}  "
          f"(ratio {fwd_per_token / (2 * n_matmul + attention):.4f}; 2N' {2 * n_matmul:.4e}, "
          f"attention {attention:.4e})")
    print(f"training FLOPs per token  {train_per_token:.4e}  vs 6N {6 * n:.4e} "
          f"(ratio {train_per_token / (6 * n):.4f})")
    print(f"layers {len(profile.layers)}, edges {len(profile.edges)}, "
          f"not counted {len(profile.not_counted)}")
    for w in profile.warnings:
        print(f"note: {w}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
