"""keras_hub MoE blocks apply does not split by experts (every one but Mixtral's, e.g.
Qwen-MoE's QwenSparseMoeBlock with its shared expert) are refused under ep by name, with
what runs instead -- not mistaken for a model without experts."""
from __future__ import annotations

import pytest

from tests.apply.helpers import cpus
from tests.apply.test_expert_parallel import ep_plan


def test_a_qwen_moe_backbone_under_ep_is_refused_naming_its_block():
    import keras
    import keras_hub

    from tfplan import apply
    from tfplan.apply.expert_parallel import ExpertParallelError, refused_moe_block

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.QwenMoeBackbone(
        vocabulary_size=32, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=16, moe_intermediate_dim=8,
        shared_expert_intermediate_dim=8, num_experts=4, top_k=2, name="qwen")
    inputs = {"token_ids": keras.Input((6,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((6,), dtype="int32", name="padding_mask")}
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(backbone(inputs)))
    blocks = [l for l in backbone._flatten_layers(include_self=False, recursive=True)
              if refused_moe_block(l)]
    assert [type(b).__name__ for b in blocks] == ["QwenSparseMoeBlock"]
    with pytest.raises(ExpertParallelError, match=r"keras_hub's \['QwenSparseMoeBlock'\]"
                                                  r".*Re-plan with ep=1"):
        apply.wrap(model, ep_plan(model, [cpus(0, 1)], ep=2))
