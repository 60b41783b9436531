"""Issue 14 end to end: plans the planner makes with the new dimensions (sequence
parallelism, selective recomputation of the attention core, context parallelism,
offloading), from the profiler's own profile of a model file, applied by ``apply.wrap``
and trained 10 steps equal to one device.

The Llama-style example (examples/llama.py: GroupQueryAttention, RMS normalization,
SwiGLU) is planned with tp=2 and sequence parallelism; the tiny causal transformer with
cp=2; the MLP with the optimizer state offloaded.
"""
from __future__ import annotations

import keras

from tfplan import apply, compat
from tfplan.apply.spmd import SpmdModel
from tfplan.apply.placement import tf_variable
from tfplan.core.presets import parse_cluster
from tfplan.planner.search import search
from tfplan.profiler.loader import load_model_source
from tfplan.profiler.static import profile_model
from tests.apply.helpers import assert_losses_match, base_model, batches_of, step_losses

STEPS = 10
BATCH = 8


def _planned(model, cluster: str, batch: int, **fix):
    profile = profile_model(model, 1, optimizer="adam")
    return search(profile, parse_cluster(cluster), batch, fix=fix).chosen


def _one_device_losses(model, loss, batches):
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    reference.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    return step_losses(reference, batches)


def _trained(model, plan, loss, batches):
    wrapped = apply.wrap(model, plan)
    wrapped.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    return wrapped, step_losses(wrapped, batches)


def test_llama_example_planned_tp2_with_sequence_parallelism_trains_like_one_device():
    source = load_model_source("examples/llama.py")
    keras.utils.set_random_seed(0)
    model = source.build_model()
    plan = _planned(model, "cpu:4", BATCH, dp=1, tp=2, sequence_parallel=True,
                    recompute="selective", zero_stage=0)
    s = plan.strategy
    assert (s.tp, s.sequence_parallel, s.recompute) == (2, True, "selective")
    split = dict(plan.tp_splits)
    attention = [l.name for l in model.layers if type(l).__name__ == "GroupedQueryAttention"]
    assert attention and all(split.get(name) == "heads" for name in attention), split
    x, y = source.sample_batch(BATCH * STEPS)
    batches = [(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
               for i in range(STEPS)]
    want = _one_device_losses(model, source.loss, batches)
    wrapped, got = _trained(model, plan, source.loss, batches)
    assert_losses_match(got, want)
    assert isinstance(wrapped, SpmdModel) and wrapped.run_description.sequence_parallel
    for copy in wrapped.device_models:  # the attention cores recomputed, not whole layers
        assert all(compat.attention_core_is_wrapped(copy.get_layer(name)) for name in attention)


def test_tiny_transformer_planned_with_context_parallelism_trains_like_one_device():
    module, model = base_model("tiny_transformer")
    plan = _planned(model, "cpu:4", 16, dp=2, cp=2, zero_stage=0)
    assert (plan.strategy.dp, plan.strategy.cp) == (2, 2)
    assert len(plan.stages[0].devices) == 4
    batches = batches_of(module, STEPS, 16)
    want = _one_device_losses(model, module.loss, batches)
    _, got = _trained(model, plan, module.loss, batches)
    assert_losses_match(got, want)


def test_mlp_planned_with_offloaded_optimizer_state_trains_like_one_device():
    module, model = base_model("tiny_mlp")
    plan = _planned(model, "cpu:4", 16, dp=2, offload="optimizer", zero_stage=1)
    assert plan.strategy.offload == "optimizer"
    batches = batches_of(module, STEPS, 16)
    want = _one_device_losses(model, module.loss, batches)
    wrapped, got = _trained(model, plan, module.loss, batches)
    assert_losses_match(got, want)
    slots = [v for v in wrapped.optimizer.variables if "iteration" not in v.path
             and "learning_rate" not in v.path]
    assert slots and all(tf_variable(v).device.endswith("CPU:0") for v in slots)
