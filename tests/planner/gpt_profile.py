"""A hand-made ModelProfile of the GPT in ``examples/gpt_megatron.py`` (no TensorFlow).

Same layer names, types and order as ``benchmarks/profile_gpt.build_gpt`` (Embedding,
then per block LayerNormalization, MultiHeadAttention, Add, LayerNormalization,
Dense 4h, Dense h, Add; a final LayerNormalization and an untied Dense head), with
the textbook counts for ``batch`` samples of ``seq`` tokens under mixed_float16 and
Adam: FLOPs 2 per multiply-add (matmuls and the attention scores and context,
2*2*s^2*h per layer), backward twice the forward (Narayanan et al., SC'21, Sec. 5.1);
bytes per parameter 4 (float32 master) + 2 (float16 copy) + 4 (gradient) + 8 (Adam).

Saved activations of the attention layer (a heads, b samples, s tokens, float16) as
Korthikanti et al. (2022, Sec. 4.1) count Megatron's, which has attention dropout: its
core -- the softmax output (2 a s^2 b), the dropout mask (a s^2 b) and the dropout
output (2 a s^2 b), 5 a s^2 b -- plus Q, K, V and the context (4 x 2 b s h) and the
output dropout's mask and output (3 b s h, rounded here to one more 2 b s h tensor):
5 a s^2 b + 10 b s h. (The stock Keras GPT of ``benchmarks/profile_gpt.py`` has no
dropout: the profiler finds 6 a s^2 b there, the float32 softmax output and its float16
copy.) The attention fields: ``attention_core_flops_fwd`` the scores and context
matmuls (4 b s^2 h; the core's element-wise work is left out, like every element-wise
FLOP here), ``attention_core_saved_bytes`` 5 a s^2 b, ``attention_kv_bytes`` the
float16 keys and values (2 x 2 b s h), ``attention_kv_heads`` a.
"""
from __future__ import annotations

from tfplan.profiler.model_profile import LayerProfile, ModelProfile


def gpt_profile(layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048,
                batch: int = 1) -> ModelProfile:
    h, s, b = hidden, seq, batch
    act = 2 * b * s * h  # one float16 [b, s, h] tensor

    def layer(name, kind, params, flops_fwd, out_bytes, saved_bytes, inputs, in_bytes,
              **attention):
        # contractions: Dense, attention (projections, scores, context); the rest
        # (normalization, residual adds, embedding lookup) are element-wise. Traffic of
        # the element-wise work as fused kernels move it: inputs, outputs and saved
        # tensors once forward, twice backward (planner.cost_model.fused_traffic_bytes)
        matmul = kind in ("Dense", "MultiHeadAttention")
        traffic = in_bytes + out_bytes + saved_bytes
        return LayerProfile(
            name=name, type=kind, params=params, trainable_params=params,
            param_bytes=4 * params, grad_bytes=4 * params, optimizer_bytes=8 * params,
            activation_bytes=out_bytes, flops_fwd=flops_fwd, flops_bwd=2 * flops_fwd,
            inputs=inputs, trainable_param_bytes=4 * params, compute_weight_bytes=2 * params,
            activation_saved_bytes=saved_bytes, input_bytes=in_bytes,
            matmul_flops_fwd=flops_fwd if matmul else 0,
            matmul_flops_bwd=2 * flops_fwd if matmul else 0,
            memory_traffic_bytes_fwd=traffic, memory_traffic_bytes_bwd=2 * traffic,
            **attention)

    out = [layer("wte", "Embedding", vocab * h, 0, act, act, ("tokens",), 4 * b * s)]
    prev = "wte"
    for i in range(layers):
        core_saved = 5 * heads * s * s * b  # softmax output, dropout mask and output
        out += [
            layer(f"ln1_{i}", "LayerNormalization", 2 * h, 8 * b * s * h, act, act, (prev,), act),
            layer(f"attn_{i}", "MultiHeadAttention", 4 * h * h + 4 * h,
                  8 * b * s * h * h + 4 * b * s * s * h, act, core_saved + 5 * act,
                  (f"ln1_{i}",), act, attention_core_flops_fwd=4 * b * s * s * h,
                  attention_core_saved_bytes=core_saved, attention_kv_bytes=2 * act,
                  attention_kv_heads=heads),
            layer(f"res1_{i}", "Add", 0, b * s * h, act, 0, (prev, f"attn_{i}"), 2 * act),
            layer(f"ln2_{i}", "LayerNormalization", 2 * h, 8 * b * s * h, act, act,
                  (f"res1_{i}",), act),
            layer(f"fc_{i}", "Dense", 4 * h * h + 4 * h, 8 * b * s * h * h, 4 * act, 8 * act,
                  (f"ln2_{i}",), act),
            layer(f"proj_{i}", "Dense", 4 * h * h + h, 8 * b * s * h * h, act, act,
                  (f"fc_{i}",), 4 * act),
            layer(f"res2_{i}", "Add", 0, b * s * h, act, 0, (f"res1_{i}", f"proj_{i}"),
                  2 * act),
        ]
        prev = f"res2_{i}"
    logits = 2 * b * s * vocab
    out += [layer("ln_f", "LayerNormalization", 2 * h, 8 * b * s * h, act, act, (prev,), act),
            layer("lm_head", "Dense", h * vocab, 2 * b * s * h * vocab, logits, logits,
                  ("ln_f",), act)]
    from tfplan.profiler.model_profile import Edge
    edges = [Edge("tokens", "wte", 4 * b * s)]
    for l in out:
        edges += [Edge(src, l.name, 0) for src in l.inputs if src != "tokens"]
    by_name = {l.name: l for l in out}
    edges = [Edge(e.src, e.dst, by_name[e.src].activation_bytes) if e.src in by_name else e
             for e in edges]
    return ModelProfile(model_name="gpt", batch_size=b, precision="mixed_float16",
                        optimizer="adam", optimizer_slots_per_param=2, layers=tuple(out),
                        edges=tuple(edges))
