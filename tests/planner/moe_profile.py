"""A hand-made ModelProfile of a Switch-style mixture-of-experts GPT (no TensorFlow).

``gpt_profile``'s layers with every block's two feed-forward Dense layers replaced by one
``MixtureOfExperts`` layer ``moe_i`` of E experts, each a 2-layer FFN of width ``ffn``
(Fedus et al., "Switch Transformers", JMLR 2022: top-1 routing; GShard top-2). For b
samples of s tokens, T = b s tokens, h hidden, float16 activations, Adam in
mixed_float16 (16 bytes of state + 2 of compute copy per parameter, as ``gpt_profile``):

- params: router h E + experts E x 2 h ffn (``moe_expert_params`` the latter);
- FLOPs forward (routed): router 2 T h E + experts k T x 2 x 2 h ffn
  (``moe_expert_flops_fwd`` the latter); backward twice the forward;
- ``moe_dispatch_bytes`` = T k h x 2 bytes; saved activations: the layer's input, the
  dispatched tokens (T k h x 2) and the experts' hidden activations (T k ffn x 2).
"""
from __future__ import annotations

from dataclasses import replace

from tfplan.profiler.model_profile import Edge, LayerProfile, ModelProfile
from tests.planner.gpt_profile import gpt_profile


def moe_layer(name: str, inputs: tuple[str, ...], hidden: int, ffn: int, experts: int,
              tokens: int, top_k: int = 1, capacity_factor: float = 0.0) -> LayerProfile:
    h, e, t, k = hidden, experts, tokens, top_k
    expert_params = e * 2 * h * ffn
    params = h * e + expert_params
    expert_flops = k * t * 2 * 2 * h * ffn
    flops = 2 * t * h * e + expert_flops
    act = 2 * t * h
    dispatch = t * k * h * 2
    saved = act + dispatch + 2 * t * k * ffn
    return LayerProfile(
        name=name, type="MixtureOfExperts", params=params, trainable_params=params,
        param_bytes=4 * params, grad_bytes=4 * params, optimizer_bytes=8 * params,
        activation_bytes=act, flops_fwd=flops, flops_bwd=2 * flops, inputs=inputs,
        trainable_param_bytes=4 * params, compute_weight_bytes=2 * params,
        activation_saved_bytes=saved, input_bytes=act, matmul_flops_fwd=flops,
        matmul_flops_bwd=2 * flops, memory_traffic_bytes_fwd=2 * act + saved,
        memory_traffic_bytes_bwd=2 * (2 * act + saved),
        moe_experts=e, moe_top_k=k, moe_expert_params=expert_params,
        moe_capacity_factor=capacity_factor, moe_tokens=t, moe_dispatch_bytes=dispatch,
        moe_expert_flops_fwd=expert_flops)


def moe_gpt_profile(layers: int, hidden: int, heads: int, experts: int, ffn: int,
                    top_k: int = 1, capacity_factor: float = 0.0, vocab: int = 32000,
                    seq: int = 2048, batch: int = 1) -> ModelProfile:
    """``gpt_profile(layers, hidden, heads)`` with ``fc_i``/``proj_i`` of every block replaced
    by ``moe_i`` (module docstring)."""
    dense = gpt_profile(layers, hidden, heads, vocab=vocab, seq=seq, batch=batch)
    out = []
    for l in dense.layers:
        if l.name.startswith("fc_"):
            i = l.name[3:]
            out.append(moe_layer(f"moe_{i}", l.inputs, hidden, ffn, experts, batch * seq,
                                 top_k, capacity_factor))
        elif l.name.startswith("proj_"):
            continue
        elif l.name.startswith("res2_"):
            i = l.name[5:]
            out.append(replace(l, inputs=(f"res1_{i}", f"moe_{i}")))
        else:
            out.append(l)
    by_name = {l.name: l for l in out}
    edges = [Edge("tokens", "wte", 4 * batch * seq)]
    edges += [Edge(src, l.name, by_name[src].activation_bytes)
              for l in out for src in l.inputs if src in by_name]
    return ModelProfile(model_name="moe_gpt", batch_size=batch, precision="mixed_float16",
                        optimizer="adam", optimizer_slots_per_param=2, layers=tuple(out),
                        edges=tuple(edges))
