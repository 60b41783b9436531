"""A hand-made ModelProfile of the GPT in ``examples/gpt_megatron.py`` (no TensorFlow).

Same layer names, types and order as ``benchmarks/profile_gpt.build_gpt`` (Embedding,
then per block LayerNormalization, MultiHeadAttention, Add, LayerNormalization,
Dense 4h, Dense h, Add; a final LayerNormalization and an untied Dense head), with
the textbook counts for ``batch`` samples of ``seq`` tokens under mixed_float16 and
Adam: FLOPs 2 per multiply-add (matmuls and the attention scores and context,
2*2*s^2*h per layer), backward twice the forward (Narayanan et al., SC'21, Sec. 5.1);
bytes per parameter 4 (float32 master) + 2 (float16 copy) + 4 (gradient) + 8 (Adam).
"""
from __future__ import annotations

from tfplan.profiler.model_profile import LayerProfile, ModelProfile


def gpt_profile(layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048,
                batch: int = 1) -> ModelProfile:
    h, s, b = hidden, seq, batch
    act = 2 * b * s * h  # one float16 [b, s, h] tensor

    def layer(name, kind, params, flops_fwd, out_bytes, saved_bytes, inputs, in_bytes):
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
            memory_traffic_bytes_fwd=traffic, memory_traffic_bytes_bwd=2 * traffic)

    out = [layer("wte", "Embedding", vocab * h, 0, act, act, ("tokens",), 4 * b * s)]
    prev = "wte"
    for i in range(layers):
        scores = 2 * b * heads * s * s  # float16 scores, then probabilities
        out += [
            layer(f"ln1_{i}", "LayerNormalization", 2 * h, 8 * b * s * h, act, act, (prev,), act),
            layer(f"attn_{i}", "MultiHeadAttention", 4 * h * h + 4 * h,
                  8 * b * s * h * h + 4 * b * s * s * h, act, 2 * scores + 5 * act,
                  (f"ln1_{i}",), act),
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
