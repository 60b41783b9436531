"""tfplan.compat: every private Keras/TensorFlow API the project relies on, exercised for
real on tiny models, so that a Keras or TensorFlow upgrade that moves or changes one
fails here (and not as a silently wrong placement, loss or gradient).

One test per entry, plus: the installed versions are the ones ``compat.VERSIONS``
names (and ``pyproject.toml`` pins), and no other module names Keras' or TensorFlow's
private packages. (The wrapped models' Keras names: tests/apply/test_legacy_names.py.)
"""
from __future__ import annotations

import os
import re
from importlib.metadata import version

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfplan import compat

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mlp(name: str = "mlp") -> keras.Model:
    inputs = keras.Input((4,), name="x")
    hidden = keras.layers.Dense(3, name="a")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, name="b")(hidden), name=name)


def _strategy() -> tf.distribute.MirroredStrategy:
    devices = ["/device:CPU:0", "/device:CPU:1"]
    return tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice(devices[0]))


# --- versions -----------------------------------------------------------------------------

def test_installed_versions_are_the_checked_ones():
    assert version("keras") == compat.VERSIONS["keras"] == keras.__version__
    assert version("tensorflow") == compat.VERSIONS["tensorflow"] == tf.__version__


def test_pyproject_pins_the_checked_minor_releases():
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    for package, checked in compat.VERSIONS.items():
        major, minor, _ = checked.split(".")
        pin = re.search(rf'"{package}>=([0-9.]+),<([0-9.]+)"', text)
        assert pin is not None, f"{package} is not pinned in pyproject.toml"
        assert pin.group(1) in (checked, f"{major}.{minor}")
        assert pin.group(2) == f"{major}.{int(minor) + 1}"


def test_only_compat_names_keras_and_tensorflow_private_packages():
    # the acceptance check (a grep for the two private package names in *.py files),
    # its pattern spelt so that this line does not match it
    pattern = re.compile("|".join(".".join(parts) for parts in (("keras", "src"),
                                                                ("tensorflow", "python"))))
    found = []
    for folder, dirs, files in os.walk(ROOT):
        # the sources, not copies: `pip install .` leaves a build/ folder behind
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in (
            "__pycache__", "build", "dist") and not d.endswith(".egg-info")]
        for f in files:
            path = os.path.join(folder, f)
            if f.endswith(".py") and os.path.relpath(path, ROOT) != os.path.join(
                    "namespace", "compat.py"):
                found += [f"{path}:{i}" for i, line in enumerate(open(path), 1)
                          if pattern.search(line)]
    assert found == []


def test_a_missing_internal_names_the_versions_to_install():
    with pytest.raises(compat.KerasInternalsError, match=r"keras>=3\.15\.1,<3\.16"):
        compat.conv_causal_padding(keras.layers.Dense(1))  # a Dense has no such method


# --- models and the trainer ---------------------------------------------------------------

def test_functional_class_is_what_keras_model_returns():
    Functional = compat.functional_class()
    model = _mlp()
    assert type(model) is Functional and issubclass(Functional, keras.Model)
    assert not isinstance(keras.Sequential([keras.Input((2,))]), Functional)


def test_functional_from_config_gives_a_plain_functional_with_the_same_graph():
    Functional = compat.functional_class()

    class Sub(Functional):
        pass

    inputs = keras.Input((4,))
    sub = Sub(inputs, keras.layers.Dense(2, name="d")(inputs), name="sub")
    again = compat.functional_from_config(sub.get_config())
    assert type(again) is Functional and again.name == "sub"
    assert [l.name for l in again.layers] == [l.name for l in sub.layers]
    again.set_weights(sub.get_weights())
    x = np.arange(8, dtype="float32").reshape(2, 4)
    np.testing.assert_allclose(again(x), sub(x))


def test_pythonify_logs_gives_python_floats():
    logs = compat.pythonify_logs({"loss": tf.constant(1.5), "mae": np.float32(0.25)})
    assert logs == {"loss": 1.5, "mae": 0.25}
    assert all(type(v) is float for v in logs.values())


def test_unscale_loss_for_distribution_multiplies_by_the_replicas():
    assert float(compat.unscale_loss_for_distribution(tf.constant(1.5))) == 1.5
    strategy = _strategy()
    out = strategy.run(lambda: compat.unscale_loss_for_distribution(tf.constant(1.5)))
    assert [float(v) for v in strategy.experimental_local_results(out)] == [3.0, 3.0]


def test_class_weight_to_sample_weights():
    y = np.array([0, 1, 1, 0])
    weights = compat.class_weight_to_sample_weights(y, {0: 2.0, 1: 0.5})
    np.testing.assert_allclose(weights, [2.0, 0.5, 0.5, 2.0])


def test_assert_compile_called():
    model = _mlp()
    with pytest.raises(ValueError, match="compile"):
        compat.assert_compile_called(model, "train_on_batch")
    model.compile(optimizer="sgd", loss="mse")
    compat.assert_compile_called(model, "train_on_batch")


def test_maybe_symbolic_build_builds_the_compiled_metrics_under_a_strategy():
    with _strategy().scope():
        model = _mlp()
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    before = len(model.metrics_variables)
    compat.maybe_symbolic_build(model, data_batch=(np.ones((2, 4), "float32"),
                                                   np.ones((2, 2), "float32"), None))
    assert len(model.metrics_variables) > before  # mae's total and count


def test_flatten_metrics_in_order():
    model = _mlp()
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    model.train_on_batch(np.ones((2, 4)), np.ones((2, 2)))
    assert compat.flatten_metrics_in_order(model, {"mae": 2.0, "loss": 1.0}) == [1.0, 2.0]
    plain = _mlp()
    plain.compile(optimizer="sgd", loss="mse")
    assert compat.flatten_metrics_in_order(plain, {"loss": 1.0}) == 1.0


def test_call_has_training_arg():
    class NoTraining(keras.layers.Layer):
        def call(self, x):
            return x

    class Training(keras.layers.Layer):
        def call(self, x, training=None):
            return x

    assert compat.call_has_training_arg(_mlp())
    assert compat.call_has_training_arg(Training())
    assert not compat.call_has_training_arg(NoTraining())


def test_compute_loss_adds_the_regularization_losses():
    inputs = keras.Input((2,))
    dense = keras.layers.Dense(1, kernel_initializer="ones", bias_initializer="zeros",
                               kernel_regularizer=keras.regularizers.L2(0.1))
    model = keras.Model(inputs, dense(inputs))
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.array([[1.0, 2.0]], "float32"), np.array([[1.0]], "float32")
    y_pred = model(x, training=True)
    loss = compat.compute_loss(model, x=x, y=y, y_pred=y_pred, sample_weight=None)
    assert float(loss) == pytest.approx((3.0 - 1.0) ** 2 + 0.1 * 2.0)  # mse + 0.1*|k|^2


def test_loss_tracker_is_the_loss_log():
    model = _mlp()
    with pytest.raises(compat.KerasInternalsError):
        compat.loss_tracker(model)  # no tracker before compile()
    model.compile(optimizer="sgd", loss="mse")
    tracker = compat.loss_tracker(model)
    assert isinstance(tracker, keras.metrics.Mean) and tracker.name == "loss"
    assert tracker in model.metrics
    tracker.update_state(3.0)
    tracker.update_state(5.0)
    assert float(tracker.result()) == 4.0


def test_run_through_graph_override_runs_on_every_forward_pass():
    calls: list[str] = []

    @compat.overrides_run_through_graph
    class Recording(compat.functional_class()):
        def _run_through_graph(self, inputs, operation_fn=lambda op: op, call_fn=None):
            def recorded(op):
                calls.append(op.name)
                return operation_fn(op)

            return super()._run_through_graph(inputs, operation_fn=recorded, call_fn=call_fn)

    assert compat.RUN_THROUGH_GRAPH in vars(Recording)
    base = _mlp()
    model = Recording(base.input, base.output)
    x = np.ones((2, 4), "float32")
    model(x)  # (Keras may run the graph symbolically first: each pass calls a, b)
    assert calls and calls == ["a", "b"] * (len(calls) // 2)
    calls.clear()
    model.compile(optimizer="sgd", loss="mse")
    model.train_on_batch(x, np.ones((2, 2), "float32"))  # traced in a tf.function
    assert calls and calls == ["a", "b"] * (len(calls) // 2)


def test_run_graph_walks_keras_graph_with_any_values_and_the_training_flag():
    """compat.run_graph (Keras' own walk, past a subclass's override) with
    compat.functional_operation (the training flag) and
    compat.standardize_functional_inputs / unpack_singleton, as apply.joint_forward uses
    them: values that are not tensors pass through, each layer sees training=True."""
    inputs = keras.Input((4,), name="x")
    dropped = keras.layers.Dropout(0.5, name="drop", seed=1)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="b")(dropped))
    seen, outputs = [], {}

    class Box:  # not a tensor, not a sequence: a leaf the walk hands on as it is
        def __init__(self, value):
            self.value = value

    def operation_fn(op):
        call = compat.functional_operation(op, training=True)

        def run(box, **kwargs):
            seen.append((op.name, type(box).__name__))
            result = call(box.value, **kwargs)
            outputs[op.name] = result
            return Box(result)
        return run

    x = np.ones((3, 4), "float32")
    flat = compat.standardize_functional_inputs(model, x)
    assert len(flat) == 1 and tuple(flat[0].shape) == (3, 4)
    out = compat.unpack_singleton(compat.run_graph(model, [Box(flat[0])], operation_fn))
    assert seen == [("drop", "Box"), ("b", "Box")]
    # training=True reached Dropout: it zeroed some of the ones and scaled the rest by 2
    dropped_out = np.asarray(outputs["drop"])
    assert set(np.unique(dropped_out)) == {0.0, 2.0}
    assert isinstance(out, Box) and tuple(out.value.shape) == (3, 2)
    assert compat.unpack_singleton([5]) == 5


def test_overrides_run_through_graph_refuses_a_class_that_does_not_override_it():
    with pytest.raises(TypeError, match="does not define it"):
        compat.overrides_run_through_graph(type("Plain", (compat.functional_class(),), {}))


def test_optimizer_strategy():
    strategy = _strategy()
    with strategy.scope():
        inside = keras.optimizers.SGD()
        scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    outside = keras.optimizers.SGD()
    assert compat.optimizer_strategy(inside) is strategy
    assert compat.optimizer_strategy(scaled) is strategy
    assert compat.optimizer_strategy(outside) is not strategy


def test_global_norm():
    values = [tf.constant([3.0]), tf.constant([[4.0, 12.0]])]
    assert float(compat.global_norm(values)) == pytest.approx(13.0)


def test_all_reduce_sum_gradients_sums_across_replicas_in_apply_gradients():
    """Keras calls it inside apply_gradients under a strategy; replacing it on the
    optimizer object (as apply.clipping does) stops the sum."""
    strategy = _strategy()
    with strategy.scope():
        variable = keras.Variable(0.0)
        optimizer = keras.optimizers.SGD(learning_rate=1.0)
        optimizer.build([variable])
    compat.check_all_reduce_sum_gradients(optimizer)
    calls = []
    original = getattr(optimizer, compat.ALL_REDUCE_SUM_GRADIENTS)

    def recording(grads_and_vars):
        calls.append(1)
        return original(grads_and_vars)

    def step(gradient_fn):
        @tf.function
        def run():
            def replica():
                ctx = tf.distribute.get_replica_context()
                gradient = tf.cast(ctx.replica_id_in_sync_group + 1, "float32")  # 1, 2
                optimizer.apply_gradients([(gradient, variable)])
            strategy.run(replica)
        object.__setattr__(optimizer, compat.ALL_REDUCE_SUM_GRADIENTS, gradient_fn)
        try:
            run()
        finally:
            object.__delattr__(optimizer, compat.ALL_REDUCE_SUM_GRADIENTS)
        return [float(v) for v in strategy.experimental_local_results(variable.value)]

    assert step(recording) == [-3.0, -3.0]  # the sum 1 + 2 on every replica
    assert calls  # Keras called it
    variable.assign(0.0)
    assert step(list) == [-1.0, -2.0]  # not summed: each replica its own gradient


def test_check_all_reduce_sum_gradients_refuses_an_optimizer_without_it():
    compat.check_all_reduce_sum_gradients(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()))
    with pytest.raises(compat.KerasInternalsError, match="_all_reduce_sum_gradients"):
        compat.check_all_reduce_sum_gradients(object())


# --- the functional graph -----------------------------------------------------------------

def test_layer_graph_and_inner_functional():
    functional = _mlp()
    assert compat.layer_graph(functional) is functional and compat.has_layer_graph(functional)
    sequential = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")])
    inner = compat.inner_functional(sequential)
    assert inner is not None and compat.layer_graph(sequential) is inner
    assert [l.name for l in inner.layers][-1] == "d"

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    subclassed = Subclassed()
    subclassed(np.ones((1, 4)))
    assert compat.layer_graph(subclassed) is None and not compat.has_layer_graph(subclassed)
    assert compat.inner_functional(functional) is None


def test_nodes_by_depth_walks_from_the_inputs():
    model = _mlp()
    graph = compat.nodes_by_depth(model)
    order = [node.operation.name for depth in sorted(graph, reverse=True)
             for node in graph[depth]]
    assert order == ["x", "a", "b"]
    (output_node,) = graph[0]
    assert [compat.producer(t).name for t in output_node.input_tensors] == ["a"]


def test_keras_history_and_producer():
    inputs = keras.Input((4,), name="x")
    dense = keras.layers.Dense(2, name="d")
    out = keras.ops.relu(dense(inputs))
    history = compat.keras_history(out)
    assert type(history.operation).__name__ == "Relu" and history.tensor_index == 0
    assert compat.producer(history.operation.input) is dense
    assert compat.producer(inputs).name == "x"  # the InputLayer
    assert compat.keras_history(np.ones(2)) is None and compat.producer(tf.ones(2)) is None


def test_inbound_nodes_counts_the_calls_of_a_shared_layer():
    shared = keras.layers.Dense(4, name="shared")
    inputs = keras.Input((4,))
    keras.Model(inputs, shared(shared(inputs)))
    assert len(compat.inbound_nodes(shared)) == 2
    assert compat.inbound_nodes(keras.layers.Dense(1)) == []


# --- layer internals ----------------------------------------------------------------------

def test_node_call_arguments_are_the_symbolic_arguments_of_the_call():
    inputs = keras.Input((4,), name="x")
    dense = keras.layers.Dense(3, name="a")
    out = dense(inputs, training=True)
    args, kwargs = compat.node_call_arguments(compat.inbound_nodes(dense)[0])
    assert args[0] is inputs and kwargs == {"training": True}
    assert out.shape == (None, 3)


def test_free_storage_empties_a_variable_and_keeps_its_keras_shape():
    layer = keras.layers.Dense(3)
    layer.build((None, 4))
    compat.free_storage(layer.kernel)
    assert tuple(layer.kernel.shape) == (4, 3) and layer.kernel.dtype == "float32"
    assert tuple(layer.kernel.value.shape) == (0,)
    full = np.ones((4, 3), "float32")
    with keras.StatelessScope(state_mapping=[(layer.kernel, full)]):
        out = layer(np.ones((1, 4), "float32"))  # reads the mapped value
    np.testing.assert_allclose(np.asarray(out), [[4.0, 4.0, 4.0]])


def test_fill_in_arguments_puts_values_in_place_of_a_nodes_keras_tensors():
    a, b = keras.Input((4,), name="a"), keras.Input((4,), name="b")
    add = keras.layers.Add(name="add")
    add([a, b])
    node = compat.inbound_nodes(add)[0]
    args, kwargs = compat.fill_in_arguments(node, {id(a): "A", id(b): "B"})
    assert args == (["A", "B"],) and kwargs == {}


def test_functional_outputs_packs_flat_values_as_the_call_returns_them():
    x = keras.Input((2,), name="x")
    model = keras.Model(x, {"p": keras.layers.Dense(1)(x), "q": keras.layers.Dense(3)(x)})
    flat = [object(), object()]
    out = compat.functional_outputs(model, flat)
    assert isinstance(out, dict) and sorted(out) == ["p", "q"]
    assert {id(v) for v in out.values()} == {id(v) for v in flat}
    single = keras.Model(x, keras.layers.Dense(1)(x))
    assert compat.functional_outputs(single, ["only"]) == "only"


def test_replay_symbolically_runs_a_call_on_placeholders_and_adds_no_node():
    inputs = keras.Input((4,), name="x")
    dense = keras.layers.Dense(3, name="a")
    dense(inputs)
    seen = []
    spec = compat.replay_symbolically(lambda x: seen.append(x) or dense(x) * 2, inputs)
    assert tuple(spec.shape) == (None, 3) and len(seen) == 1
    assert not isinstance(seen[0], keras.KerasTensor)  # a backend placeholder
    assert len(compat.inbound_nodes(dense)) == 1


def test_analyze_einsum_string_gives_the_shapes_einsum_dense_builds():
    assert compat.analyze_einsum_string("ab,bc->ac", "c", (None, 4), (3,)) == (
        [4, 3], [3], [None, 3])
    kernel, bias, full = compat.analyze_einsum_string("abc,cde->abde", None, (None, 5, 4),
                                                      (None, 2, 3))
    layer = keras.layers.EinsumDense("abc,cde->abde", (None, 2, 3))
    layer.build((None, 5, 4))
    assert tuple(kernel) == tuple(layer.kernel.shape) and bias is None
    assert tuple(full) == (None, None, 2, 3)


def test_keras_masks():
    ids = np.array([[1, 0, 2]])
    embedded = keras.layers.Embedding(5, 2, mask_zero=True)(ids)
    np.testing.assert_array_equal(compat.get_keras_mask(embedded), [[True, False, True]])
    plain = tf.ones((1, 3, 2))
    assert compat.get_keras_mask(plain) is None
    compat.set_keras_mask(plain, tf.constant([[True, True, False]]))
    np.testing.assert_array_equal(compat.get_keras_mask(plain), [[True, True, False]])


def test_drop_unsplit_kernel_and_embeddings():
    dense = keras.layers.Dense(2)
    dense.build((None, 3))
    compat.drop_unsplit_kernel(dense)
    assert dense.kernel is None
    embedding = keras.layers.Embedding(4, 2)
    embedding.build()
    compat.drop_unsplit_embeddings(embedding)
    assert embedding.embeddings is None


def test_conv_causal_padding_is_what_conv1d_pads():
    conv = keras.layers.Conv1D(1, 3, dilation_rate=2, padding="causal",
                               kernel_initializer="ones", use_bias=False)
    assert compat.conv_causal_padding(conv) == [[0, 0], [4, 0], [0, 0]]
    x = np.arange(10, dtype="float32").reshape(1, 10, 1)
    padded = keras.ops.pad(x, compat.conv_causal_padding(conv))
    valid = keras.ops.conv(padded, np.ones((3, 1, 1), "float32"), padding="valid",
                           dilation_rate=2)
    np.testing.assert_allclose(valid, conv(x))


def test_attention_settings():
    layer = keras.layers.MultiHeadAttention(
        2, 3, output_shape=5, kernel_initializer="ones",
        bias_regularizer=keras.regularizers.L2(0.5), kernel_constraint="non_neg")
    settings = compat.attention_settings(layer)
    assert settings.output_shape == (5,) and settings.use_gate is False
    assert isinstance(settings.kernel["initializer"], keras.initializers.Ones)
    assert isinstance(settings.kernel["constraint"], keras.constraints.NonNeg)
    assert settings.kernel["regularizer"] is None
    assert settings.bias["regularizer"].l2 == 0.5
    assert compat.attention_settings(keras.layers.MultiHeadAttention(2, 3)).output_shape is None


def test_attention_scores_is_scaled_dot_product_attention():
    layer = keras.layers.MultiHeadAttention(2, 3)
    compat.build_attention(layer, 4)
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(1, 4, 2, 3)).astype("float32") for _ in range(3))
    out, scores = compat.attention_scores(layer, q, k, v, None, False, True)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(3.0)
    weights = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(scores, weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, np.einsum("bhqk,bkhd->bqhd", weights, v), rtol=1e-5,
                               atol=1e-6)


def test_attention_projection_is_each_projections_einsum_dense():
    x = np.zeros((1, 4, 6), "float32")
    for layer in (keras.layers.MultiHeadAttention(2, 3), keras.layers.GroupQueryAttention(3, 4, 2)):
        layer(x, x)
        for part in compat.ATTENTION_PROJECTIONS:
            dense = compat.attention_projection(layer, part)
            assert isinstance(dense, keras.layers.EinsumDense)
            assert any(w is dense.kernel for w in layer.weights)
    with pytest.raises(ValueError, match="part must be one of"):
        compat.attention_projection(layer, "gate")


def test_grouped_attention_scores_is_scaled_dot_product_attention():
    layer = keras.layers.GroupQueryAttention(3, 2, 1)
    layer(np.zeros((1, 4, 6), "float32"), np.zeros((1, 4, 6), "float32"))
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(1, 4, 2, 3)).astype("float32") for _ in range(3))
    out, scores = compat.grouped_attention_scores(layer, q, k, v, None, False, True)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(3.0)
    weights = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(scores, weights, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, np.einsum("bhqk,bkhd->bqhd", weights, v), rtol=1e-5,
                               atol=1e-6)
    out_only, none = compat.grouped_attention_scores(layer, q, k, v, None, False, False)
    np.testing.assert_allclose(out_only, out, rtol=1e-5, atol=1e-6)


def test_wrap_attention_core_replaces_the_core_of_one_instance():
    calls = []

    def wrap(core):
        def run(*args, **kwargs):
            calls.append(len(args))
            return core(*args, **kwargs)
        return run

    x = np.random.default_rng(0).normal(size=(1, 4, 5)).astype("float32")
    for layer in (keras.layers.MultiHeadAttention(2, 3),
                  keras.layers.GroupQueryAttention(head_dim=3, num_query_heads=4,
                                                   num_key_value_heads=2)):
        calls.clear()
        expected = layer(x, x)  # built, not wrapped
        other = type(layer).from_config(layer.get_config())
        compat.wrap_attention_core(layer, wrap)
        assert compat.attention_core_is_wrapped(layer)
        assert not compat.attention_core_is_wrapped(other)
        np.testing.assert_allclose(layer(x, x), expected, rtol=1e-6)
        assert len(calls) == 1  # the call went through the wrapper, the output alone
        out, scores = layer(x, x, return_attention_scores=True)  # the original core
        assert len(calls) == 1 and tuple(scores.shape)[2:] == (4, 4)  # (b, heads, t, s)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_attention_mask_combines_causal_and_padding_masks():
    layer = keras.layers.MultiHeadAttention(2, 3)
    query = tf.ones((1, 3, 4))
    causal = compat.attention_mask(layer, query, query, use_causal_mask=True)
    np.testing.assert_array_equal(causal, np.tril(np.ones((1, 3, 3), bool)))
    padded = compat.attention_mask(layer, query, query,
                                   value_mask=tf.constant([[True, True, False]]))
    np.testing.assert_array_equal(np.broadcast_to(padded, (1, 3, 3)),
                                  np.tile([[[True, True, False]]], (1, 3, 1)))


def test_the_projections_keras_saves_are_the_ones_compat_sets():
    built = keras.layers.MultiHeadAttention(2, 3)
    query = np.ones((1, 3, 4), "float32")
    built(query, query)
    for part in compat.ATTENTION_PROJECTIONS:  # the public views of what compat sets
        assert isinstance(getattr(built, f"{part}_dense"), keras.layers.EinsumDense)
    layer = keras.layers.MultiHeadAttention(2, 3)  # set while building (not built yet)
    replacement = keras.layers.Dense(1, name="replacement")
    compat.set_attention_projection(layer, "query", replacement)
    assert layer.query_dense is replacement
    with pytest.raises(ValueError, match="part must be one of"):
        compat.set_attention_projection(layer, "gate", replacement)


# --- TensorFlow -----------------------------------------------------------------------------

def test_local_devices_lists_cpu0_with_its_memory_limit():
    devices = compat.local_devices()
    names = [d.name for d in devices]
    assert "/device:CPU:0" in names  # (one per physical device: not the logical CPUs)
    cpu0 = devices[names.index("/device:CPU:0")]
    assert cpu0.device_type == "CPU" and cpu0.memory_limit_bytes > 0


def test_function_graph_gives_a_while_loops_body_with_shapes():
    w = tf.ones((3, 3))

    @tf.function(autograph=False)
    def loop(x):
        return tf.while_loop(lambda i, v: i < 4, lambda i, v: (i + 1, tf.matmul(v, w)),
                             (0, x))[1]

    graph = loop.get_concrete_function(tf.TensorSpec((2, 3))).graph
    (op,) = [o for o in graph.get_operations() if o.type in ("While", "StatelessWhile")]
    body = compat.function_graph(graph, op.get_attr("body").name)
    (matmul,) = [o for o in body.get_operations() if o.type == "MatMul"]
    assert matmul.outputs[0].shape.as_list() == [2, 3]
    assert len(body.inputs) == len(op.inputs) == len(body.outputs)
    assert compat.function_graph(graph, "no_such_function") is None


class _Pair(keras.layers.Layer):
    """A block whose build builds its sub-layers itself (as keras_hub's do)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(3, name="first")
        self.second = keras.layers.Dense(2, name="second")

    def build(self, input_shape):
        self.first.build(input_shape)
        self.second.build((*input_shape[:-1], 3))

    def call(self, x):
        return self.second(self.first(x))


def test_build_arguments_are_the_shapes_a_sub_layer_was_built_with():
    pair = _Pair()
    pair.build((None, 5))
    assert compat.build_arguments(pair.first) == {"input_shape": (None, 5)}
    attention = keras.layers.MultiHeadAttention(2, 4)
    attention.build(query_shape=(None, 6, 8), value_shape=(None, 6, 8))
    assert compat.build_arguments(attention) == {"query_shape": (None, 6, 8),
                                                 "value_shape": (None, 6, 8)}
    with pytest.raises(compat.PlannerError, match="was not built"):
        compat.build_arguments(keras.layers.Dense(2))


def test_replace_tracked_layer_puts_the_new_sub_layer_in_the_old_ones_place():
    pair = _Pair()
    pair.build((None, 5))
    new = keras.layers.Dense(3, name="new")
    new.build((None, 5))
    compat.replace_tracked_layer(pair, pair.first, new)
    pair.first = new  # already tracked: a built (locked) layer accepts it
    assert pair._flatten_layers(include_self=False, recursive=False) == [new, pair.second]
    assert [v.path.rsplit("/", 2)[-2:] for v in pair.weights] == [
        ["new", "kernel"], ["new", "bias"], ["second", "kernel"], ["second", "bias"]]
    assert pair(np.ones((1, 5), "float32")).shape == (1, 2)


def test_move_variable_recreates_its_storage_on_another_device():
    with tf.device("/device:CPU:0"):
        v = keras.Variable(np.arange(6.0, dtype="float32").reshape(2, 3), name="w")
    compat.move_variable(v, "/device:CPU:1")
    assert v.value.device.endswith("CPU:1")
    np.testing.assert_array_equal(v.numpy(), np.arange(6.0).reshape(2, 3))
    v.assign(np.ones((2, 3), "float32"))
    np.testing.assert_array_equal(v.numpy(), np.ones((2, 3)))
    assert v.name == "w" and v.trainable


def test_place_operations_runs_each_operation_of_one_instance_through_the_wrapper():
    model, other = _mlp(), _mlp("other")
    seen: list[str] = []

    def wrap(op, fn):
        def run(*args, **kwargs):
            seen.append(op.name)
            with tf.device("/device:CPU:1" if op.name == "b" else "/device:CPU:0"):
                return fn(*args, **kwargs)
        return run

    compat.place_operations(model, wrap)
    outer_in = keras.Input((4,))
    outer = keras.Model(outer_in, model(outer_in))

    @tf.function
    def forward(x):
        return outer(x)

    graph = forward.get_concrete_function(tf.TensorSpec((2, 4))).graph
    assert "a" in seen and "b" in seen
    devices = {op.device for op in graph.get_operations() if op.type == "MatMul"}
    assert any(d.endswith("CPU:1") for d in devices), devices
    assert any(d.endswith("CPU:0") for d in devices), devices
    seen.clear()
    other(np.ones((2, 4), "float32"))  # another instance of the class: unchanged
    assert not seen


def test_release_to_makes_a_variable_a_view_of_another_without_storage():
    owner = keras.Variable(np.arange(6.0, dtype="float32").reshape(2, 3))
    copy = keras.Variable(np.zeros((2, 3), "float32"))
    assert compat.holds_storage(copy)
    compat.release_to(copy, owner)
    assert not compat.holds_storage(copy) and compat.holds_storage(owner)
    np.testing.assert_array_equal(copy.numpy(), owner.numpy())  # reads the owner's
    copy.assign(np.ones((2, 3), "float32"))  # writes the owner
    np.testing.assert_array_equal(owner.numpy(), np.ones((2, 3)))
    with keras.StatelessScope(state_mapping=[(copy, tf.fill((2, 3), 5.0))]):
        np.testing.assert_array_equal(np.asarray(copy.value), np.full((2, 3), 5.0))
    with pytest.raises(compat.PlannerError, match="cannot view"):
        compat.release_to(keras.Variable(np.zeros(3, "float32")), owner)


def test_serialize_as_saves_a_class_under_another_ones_registered_name():
    @keras.saving.register_keras_serializable(package="compat_test")
    class Plain(keras.layers.Layer):
        pass

    class Twin(Plain):
        pass

    compat.serialize_as(Twin, Plain)
    config = keras.saving.serialize_keras_object(Twin(name="t"))
    assert config["registered_name"] == "compat_test>Plain"
    assert type(keras.saving.deserialize_keras_object(config)) is Plain


# --- what apply.audit reads of a step --------------------------------------------------------

def test_run_metadata_function_library_and_debugger_dump_give_a_steps_transfers_and_sizes(
        tmp_path):
    import tensorflow as tf

    @tf.function
    def inner(x):
        return tf.matmul(x, x)

    @tf.function
    def step(x):
        with tf.device("/device:CPU:0"):
            a = inner(x) + 1.0
        with tf.device("/device:CPU:1"):
            return a * 2.0

    before = compat.eager_function_names()
    with compat.collect_run_metadata() as collected:
        step(tf.ones([4, 4]))
    names = compat.eager_function_names() - before
    assert any("step" in n for n in names)
    sends = [n for fg in collected.metadata.function_graphs for g in fg.partition_graphs
             for n in g.node if n.op == "_Send"]
    assert any(b"CPU:1" in n.attr["recv_device"].s for n in sends)
    graphs = compat.traced_graphs(names)
    ops = {op.type for g in graphs.values() if g is not None for op in g.get_operations()}
    assert "MatMul" in ops  # the called function's graph too, with its ops
    calls = [op for g in graphs.values() if g is not None for op in g.get_operations()
             if compat.called_function_names(op)]
    assert calls and all(isinstance(n, str) for op in calls
                         for n in compat.called_function_names(op))
    step2 = tf.function(lambda x: tf.concat([x, x], 0) * 3.0)
    tf.debugging.experimental.enable_dump_debug_info(str(tmp_path), tensor_debug_mode="SHAPE",
                                                     circular_buffer_size=-1)
    try:
        step2(tf.ones([5, 3]))
    finally:
        tf.debugging.experimental.disable_dump_debug_info()
    sizes = compat.runtime_tensor_bytes(str(tmp_path))
    assert sizes[("concat", 0)] == 10 * 3 * 4 and sizes[("mul", 0)] == 120


def _compiled_dense(**compile_kwargs):
    inputs = keras.Input(shape=(3,))
    dense = keras.layers.Dense(2, kernel_regularizer=keras.regularizers.L2(0.5))
    model = keras.Model(inputs, dense(inputs))
    model.compile(optimizer="sgd", loss="mse", **compile_kwargs)
    return model, dense


def test_compiled_loss_is_the_compile_loss_alone_and_added_loss_reduces_an_add_loss():
    model, _ = _compiled_dense(metrics=["mae"])
    x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
    y_pred = model(x)
    mse = float(np.mean(np.square(y_pred.numpy())))
    assert float(compat.compiled_loss(model, y, y_pred, None)) == pytest.approx(mse, rel=1e-6)
    (penalty,) = model.losses
    assert float(compat.added_loss(model, penalty)) == pytest.approx(float(penalty))
    model.evaluate(x, y, verbose=0)  # builds the compiled metrics
    metrics = compat.compiled_metrics(model)
    assert metrics is not None and "mae" in [m.name for m in metrics.metrics]
    bare = keras.Model(model.inputs, model.outputs)
    assert compat.compiled_metrics(bare) is None and compat.compiled_loss(bare, y, y_pred,
                                                                         None) is None


def test_flatten_layers_reaches_sub_layers_at_any_depth():
    inner = keras.Sequential([keras.layers.Dense(2, name="deep")])
    model = keras.Sequential([keras.Input((3,)), inner])
    assert "deep" in [layer.name for layer in compat.flatten_layers(model)]


def test_without_replica_sum_leaves_the_gradients_as_they_are_then_restores_it():
    optimizer = keras.optimizers.SGD(0.1)
    variable = keras.Variable(np.ones(2, "float32"))
    optimizer.build([variable])
    grads = [(tf.constant([1.0, 2.0]), variable)]
    with compat.without_replica_sum(optimizer):
        assert optimizer._all_reduce_sum_gradients(grads) is grads
    assert "_all_reduce_sum_gradients" not in vars(optimizer)


def test_uses_weight_decay_follows_the_exclusions():
    optimizer = keras.optimizers.AdamW(0.1, weight_decay=0.01)
    kept = keras.Variable(np.ones(2, "float32"), name="kernel")
    left = keras.Variable(np.ones(2, "float32"), name="bias")
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    optimizer.build([kept, left])
    assert compat.uses_weight_decay(optimizer, kept)
    assert not compat.uses_weight_decay(optimizer, left)


def test_on_gradient_path_is_true_for_what_a_tape_records_only():
    v = tf.Variable(1.0)
    x = tf.constant(2.0)
    with tf.GradientTape():
        y = v * x
        assert compat.on_gradient_path(y) and not compat.on_gradient_path(x)
    assert not compat.on_gradient_path(y)  # no tape


def test_called_function_graphs_keep_the_shapes_tracing_set():
    import tensorflow as tf

    @tf.function
    def inner(x):
        y = tf.reshape(x, [-1])  # its length unknown to shape inference
        y.set_shape([12])  # and set by the tracing code, as a collective's output is
        return y * 2.0

    @tf.function
    def outer(x):
        return inner(x) + 1.0

    graph = outer.get_concrete_function(tf.TensorSpec([None, 4])).graph
    calls = [op for op in graph.get_operations() if compat.called_function_names(op)]
    assert calls
    (called,) = compat.called_function_graphs(calls[0])
    shapes = {op.name: op.outputs[0].shape for op in called.get_operations() if op.outputs}
    assert shapes["Reshape"].as_list() == [12] and shapes["mul"].as_list() == [12]
    assert compat.called_function_graphs(next(op for op in graph.get_operations()
                                              if not compat.called_function_names(op))) == []


def test_batch_norm_moments_are_the_training_statistics_and_move_nothing():
    import numpy as np

    layer = keras.layers.BatchNormalization()
    x = np.random.default_rng(0).normal(size=(4, 3, 5)).astype("float32")
    layer.build(x.shape)
    mean, variance = compat.batch_norm_moments(layer, keras.ops.convert_to_tensor(x))
    np.testing.assert_allclose(mean, x.mean(axis=(0, 1)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(variance, x.var(axis=(0, 1)), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(layer.moving_mean.numpy(), np.zeros(5))  # untouched
    mask = np.array([[1, 1, 0]] * 4, bool)  # the masked positions left out
    mean, _ = compat.batch_norm_moments(layer, keras.ops.convert_to_tensor(x), mask)
    np.testing.assert_allclose(mean, x[:, :2].mean(axis=(0, 1)), rtol=1e-4, atol=1e-5)
