"""Expert parallelism for keras_hub's Qwen-MoE block (``apply.expert_parallel_qwen``, on the
SPMD engine: ``apply.spmd.experts``): a ``QwenMoeBackbone`` (``tiny_qwen_moe``: 4 experts,
top 2, a shared expert with its sigmoid gate, a padding mask) under ep=2 (dp=2) trains 10
steps like one device (losses and final
weights within 1e-4), with the top-k gates as the user's ``norm_top_k_prob`` says; every
expert shard and its optimizer slots are on its replica's device, the shared expert is
replicated, and the wrapped model's weight file loads into the user's model. Its router
aux loss under ep is checked beside Mixtral's in tests/apply/test_expert_parallel.py."""
from __future__ import annotations

import numpy as np
import pytest

from tests.apply.helpers import cpus, fresh_optimizer, load_model_file, step_losses
from tests.apply.test_expert_parallel import STEPS, batches, copies_of, ep_plan


@pytest.mark.parametrize("norm_top_k_prob", [False, True], ids=["gates", "normalized"])
def test_qwen_moe_under_ep2_trains_like_one_device(norm_top_k_prob, tmp_path):
    import keras

    from tfplan import apply
    from tfplan.apply.checkpoint import slot_variables
    from tfplan.apply.expert_group import ExpertShards
    from tfplan.apply.placement import tf_variable

    module = load_model_file("tiny_qwen_moe")

    def fresh():
        keras.utils.set_random_seed(0)
        model = module.build_model(norm_top_k_prob=norm_top_k_prob)
        model.compile(optimizer=fresh_optimizer(module), loss=module.loss)
        return model

    model = fresh()
    w = apply.wrap(model, ep_plan(model, [cpus(0, 1)], ep=2))
    assert isinstance(w, apply.spmd.SpmdModel)
    w.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    data = batches(module, STEPS)
    np.testing.assert_allclose(step_losses(w, data), step_losses(model, data), rtol=1e-4)
    for got, want in zip(w.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    slots = slot_variables(w.optimizer)
    for r, replica in enumerate(copies_of(w)):
        blocks = [layer for layer in replica._flatten_layers(recursive=True)
                  if type(layer).__name__ == "QwenSparseMoeBlock"]
        assert len(blocks) == 1 and getattr(blocks[0], "is_expert_twin", False)
        shards = [layer for layer in replica._flatten_layers(recursive=True)
                  if isinstance(layer, ExpertShards)]
        assert len(shards) == 1 and shards[0].ep_rank == r % 2
        assert shards[0]._exchange.fn.group.devices == tuple(cpus(0, 1))  # collectives
        assert [v.shape for v in shards[0].shard_variables()] == [(2, 16, 16), (2, 8, 16)]
        for v in shards[0].shard_variables():  # 4 experts over ep=2; [E, d, 2h] fused
            for x in (v, slots[(id(v), 0)], slots[(id(v), 1)]):
                assert tf_variable(x).device.endswith(f"CPU:{r}"), (r, x.path)
        shared = blocks[0].shared_expert_dense.weights + \
            blocks[0].shared_expert_gate_dense.weights
        assert len(shared) == 4  # gate, up, down and the sigmoid gate: whole, replicated
        for v in shared:
            assert tf_variable(v).device.endswith(f"CPU:{r}"), (r, v.path)
    w.save_weights(str(tmp_path / "ep.weights.h5"))
    plain = fresh()
    plain.optimizer.build(plain.trainable_variables)
    plain.load_weights(str(tmp_path / "ep.weights.h5"))
    for got, want in zip(plain.get_weights(), w.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    more = batches(module, STEPS + 1)[STEPS:]
    np.testing.assert_allclose(step_losses(plain, more), step_losses(w, more), rtol=1e-4)
