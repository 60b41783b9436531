"""keras_hub MoE blocks apply does not split by experts (every one but Mixtral's and
Qwen-MoE's, e.g. Qwen3-MoE's Qwen3SparseMoeBlock) are refused under ep by name, with what
runs instead -- not mistaken for a model without experts; Qwen-MoE's QwenSparseMoeBlock
(with its shared expert) is no longer refused (``apply.expert_parallel_qwen``)."""
from __future__ import annotations

import pytest

from tests.apply.helpers import cpus, load_model_file
from tests.apply.test_expert_parallel import ep_plan


def _with_head(backbone):
    import keras

    inputs = {"token_ids": keras.Input((6,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((6,), dtype="int32", name="padding_mask")}
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(backbone(inputs)))


def test_a_qwen3_moe_backbone_under_ep_is_refused_naming_its_block():
    import keras
    import keras_hub

    from tfplan import apply
    from tfplan.apply.expert_parallel import ExpertParallelError, refused_moe_block

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.Qwen3MoeBackbone(
        vocabulary_size=32, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, head_dim=8, intermediate_dim=16, moe_intermediate_dim=8,
        num_experts=4, top_k=2, name="qwen3")
    model = _with_head(backbone)
    blocks = [l for l in backbone._flatten_layers(include_self=False, recursive=True)
              if refused_moe_block(l)]
    assert [type(b).__name__ for b in blocks] == ["Qwen3SparseMoeBlock"]
    with pytest.raises(ExpertParallelError, match=r"keras_hub's \['Qwen3SparseMoeBlock'\]"
                                                  r".*Re-plan with ep=1"):
        apply.wrap(model, ep_plan(model, [cpus(0, 1)], ep=2))


def test_qwen_moe_blocks_are_no_longer_refused():
    import keras

    from tfplan.apply.expert_parallel import expert_layers, refused_moe_block

    keras.utils.set_random_seed(0)
    model = load_model_file("tiny_qwen_moe").build_model()
    every = list(model._flatten_layers(include_self=False, recursive=True))
    assert not [l for l in every if refused_moe_block(l)]
    assert [type(l).__name__ for _, l in expert_layers(model)] == ["QwenSparseMoeBlock"]
