"""Every private Keras/TensorFlow API the project relies on, in one place.

Pipeline position: just above ``tfplan.core`` and below ``tfplan.profiler``; the
profiler and ``tfplan.apply`` reach Keras' and TensorFlow's internals only through
the names here, and this module imports nothing from ``tfplan`` but ``tfplan.core``.

Keras 3 and TensorFlow keep some of what a parallel-training library needs out of
their public API: the Functional model class and its graph (``_nodes_by_depth``,
``_keras_history``, ``_run_through_graph``), the trainer's step helpers
(``_compute_loss``, ``_loss_tracker``, ...), the TF optimizer's cross-replica sum
(``_all_reduce_sum_gradients``), some layer internals (MultiHeadAttention's,
EinsumDense's shape analysis) and TensorFlow's device list with memory limits.
Each one is a function or a constant below whose docstring says what it is, the
versions it was checked on (``VERSIONS``) and what its caller would get wrong
without it. ``tests/compat`` exercises every entry on a tiny model, so a Keras or
TensorFlow upgrade that moves one fails there, loudly, and not as a silently wrong
placement or gradient. Keras and TensorFlow are imported inside the functions:
importing this module is cheap, and a moved internal breaks the one feature that
needs it, with a ``KerasInternalsError`` that says what to install.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import Any, Callable, Iterator, NamedTuple, TypeVar

from tfplan.core.errors import PlannerError

VERSIONS = {"tensorflow": "2.21.0", "keras": "3.15.1"}
"""The TensorFlow and Keras releases every entry here was checked on (the pins in
``pyproject.toml`` allow their patch releases only; ``tests/compat`` checks that
the installed ones are these)."""


class KerasInternalsError(PlannerError):
    """An internal Keras/TensorFlow API this project relies on is missing or changed:
    the installed Keras or TensorFlow is not the release ``VERSIONS`` names."""


def _private(module: str, name: str, what: str) -> Any:
    """``module.name``, or a KerasInternalsError that says what to install."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise KerasInternalsError(_moved(f"{module}.{name} ({what})", e)) from e


def _moved(what: str, cause: Any) -> str:
    return (f"tf-parallel-planner relies on {what}, an internal of Keras/TensorFlow checked "
            f"on TensorFlow {VERSIONS['tensorflow']} and Keras {VERSIONS['keras']}; the "
            f"installed versions ({_installed()}) do not have it as expected ({cause}). "
            f"Install the checked releases: pip install 'keras>={VERSIONS['keras']},<3.16' "
            f"'tensorflow>={VERSIONS['tensorflow']},<2.22'.")


def _installed() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in VERSIONS:
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            found.append(f"{package} not installed")
    return ", ".join(found)


def _method(obj: Any, name: str, what: str) -> Callable[..., Any]:
    """``obj.name`` for a private method, or a KerasInternalsError."""
    try:
        return getattr(obj, name)
    except AttributeError as e:
        raise KerasInternalsError(_moved(f"{type(obj).__name__}.{name} ({what})", e)) from e


# --- models and the trainer --------------------------------------------------------------

def functional_class() -> type:
    """Keras' ``Functional`` model class (``keras.src.models.functional.Functional``).

    ``keras.Model(inputs, outputs)`` returns one, but the class itself is not public.
    ``apply.planned_model.PlannedModel`` subclasses it (a wrapped model is a Functional
    over the re-created layers) and ``apply.cloning`` tests models against it and
    builds the uncompiled twin it clones. Checked on Keras 3.15.1. Without it a
    wrapped model could not be a Functional model: no layer graph to place, no
    ``_run_through_graph`` to override, and saved files would not load as Functional.
    """
    return _private("keras.src.models.functional", "Functional", "the Functional model class")


def functional_from_config(config: dict[str, Any], custom_objects: Any = None) -> Any:
    """A plain ``Functional`` model from a Functional model's config
    (``keras.src.models.functional.functional_from_config``).

    ``PlannedModel.from_config`` uses it so that a saved wrapped model loads as a
    plain Functional model, not as the wrapped class (placement belongs to a process,
    not to a file). Checked on Keras 3.15.1. Without it ``load_model`` would call the
    wrapped class's ``__init__`` with a config it does not take (or re-create a model
    bound to devices and a strategy this process does not have).
    """
    fn = _private("keras.src.models.functional", "functional_from_config",
                  "re-creating a Functional model from its config")
    return fn(functional_class(), config, custom_objects)


def pythonify_logs(logs: Any) -> dict[str, Any]:
    """Keras' ``python_utils.pythonify_logs``: a step's logs (tensors) as Python floats.

    The ``*_on_batch`` methods of the wrapped models and the multi-worker ``fit`` loop
    return what Keras' own methods return through it. Checked on Keras 3.15.1.
    Without it they would return tensors (or per-replica values) where Keras returns
    floats, and callbacks and ``History`` would hold tensors.
    """
    return _private("keras.src.utils.python_utils", "pythonify_logs",
                    "converting step logs to Python floats")(logs)


def unscale_loss_for_distribution(loss: Any) -> Any:
    """Keras' ``losses.loss.unscale_loss_for_distribution``: a replica's loss times the
    number of replicas in sync (Keras scales each replica's loss by 1/replicas).

    ``PlannedModel.train_step`` records each micro-batch's loss in the loss tracker
    with it, as Keras' own ``train_step`` does. Checked on Keras 3.15.1. Without it a
    data-parallel model's reported loss would be the true loss divided by ``dp``.
    """
    return _private("keras.src.losses.loss", "unscale_loss_for_distribution",
                    "undoing the 1/replicas scale of a replica's loss")(loss)


def class_weight_to_sample_weights(y: Any, class_weight: Any) -> Any:
    """Keras' ``data_adapter_utils.class_weight_to_sample_weights``: per-sample weights
    from a ``class_weight`` dict, as ``fit`` makes them.

    The wrapped models' ``train_on_batch`` turn ``class_weight`` into sample weights
    with it. Checked on Keras 3.15.1. Without it ``train_on_batch(class_weight=...)``
    would weight samples differently from ``fit``.
    """
    return _private("keras.src.trainers.data_adapters.data_adapter_utils",
                    "class_weight_to_sample_weights", "class weights as sample weights")(
        y, class_weight)


def assert_compile_called(model: Any, method_name: str) -> None:
    """``Trainer._assert_compile_called``: Keras' error for a model used before
    ``compile()``.

    The wrapped models' own ``fit``/``*_on_batch`` call it first, as Keras' do.
    Checked on Keras 3.15.1. Without it an uncompiled wrapped model would fail later
    with an unrelated error (no optimizer, no loss) instead of Keras' message.
    """
    _method(model, "_assert_compile_called", "the compile() check")(method_name)


def maybe_symbolic_build(model: Any, data_batch: Any) -> None:
    """``Trainer._maybe_symbolic_build``: builds the compiled metrics and loss on a
    first batch before the step is traced.

    The wrapped models' ``*_on_batch`` call it as Keras' do. Checked on Keras 3.15.1.
    Without it the metrics' variables would be created inside the traced step (under a
    tf.distribute strategy: an error, or metrics reset with no variables).
    """
    _method(model, "_maybe_symbolic_build", "building metrics before the first step")(
        data_batch=data_batch)


def flatten_metrics_in_order(model: Any, logs: dict[str, Any]) -> Any:
    """``Trainer._flatten_metrics_in_order``: a logs dict as the list (or scalar) that
    ``*_on_batch(return_dict=False)`` returns, in ``model.metrics_names`` order.

    Checked on Keras 3.15.1. Without it the wrapped models' ``*_on_batch`` would
    return the values in another order than Keras' (or a dict) for ``return_dict=False``.
    """
    return _method(model, "_flatten_metrics_in_order", "ordering one batch's logs")(logs)


def call_has_training_arg(model: Any) -> bool:
    """``Layer._call_has_training_arg``: whether the model's ``call`` takes ``training``.

    ``PlannedModel``'s micro-batched step calls the model with ``training=True`` only
    when it does, as Keras' ``train_step``. Checked on Keras 3.15.1. Without it
    Dropout and BatchNormalization inside would run in inference mode while training.
    """
    try:
        return bool(model._call_has_training_arg)
    except AttributeError as e:
        raise KerasInternalsError(_moved("Layer._call_has_training_arg", e)) from e


def compute_loss(model: Any, x: Any, y: Any, y_pred: Any, sample_weight: Any,
                 training: bool = True) -> Any:
    """``Trainer._compute_loss``: the compiled loss plus the layers' added losses, as
    Keras' ``train_step`` computes it (it also handles a user-overridden
    ``compute_loss`` with an older signature).

    Checked on Keras 3.15.1. Without it the micro-batched step would miss the
    regularization losses or call a user's ``compute_loss`` wrongly.
    """
    return _method(model, "_compute_loss", "the train step's loss")(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)


def loss_tracker(model: Any) -> Any:
    """``Trainer._loss_tracker``: the ``Mean`` metric behind the ``loss`` log.

    ``PlannedModel``'s micro-batched step updates it once per micro-batch, as Keras'
    ``train_step`` does once per batch. Checked on Keras 3.15.1. Without it the
    ``loss`` that ``fit`` reports would not move with a micro-batched step.
    """
    tracker = getattr(model, "_loss_tracker", None)
    if tracker is None:
        raise KerasInternalsError(_moved(
            "Trainer._loss_tracker (set by compile())", "absent or None"))
    return tracker


def add_to_mean_total(metric: Any, value: Any) -> None:
    """Add ``value`` to a ``keras.metrics.Mean``'s running total alone (its ``total``
    variable; the count unchanged). The SPMD engine's workers each hold part of one
    device's loss (a pipeline stage's added losses on one worker, the loss and its count
    on the last stage's): the workers' changes to the loss tracker are summed, so the
    added part enters the total only. Checked on Keras 3.15.1."""
    total = getattr(metric, "total", None)
    if total is None or not hasattr(total, "assign_add"):
        raise KerasInternalsError(_moved("keras.metrics.Mean.total (its running sum)",
                                         "absent"))
    from keras import ops

    total.assign_add(ops.cast(value, total.dtype))


RUN_THROUGH_GRAPH = "_run_through_graph"
"""The name of ``Function._run_through_graph(inputs, operation_fn, call_fn=None)``,
which ``Functional.call`` calls with an ``operation_fn`` that wraps each operation's
call. ``apply.pipeline.PlacedModel`` overrides it to run each operation under its
device (and schedule), ``apply.data_parallel.DataParallelModel`` to recompute chosen
layers. Checked on Keras 3.15.1. If Keras stopped calling it, the overrides would
never run: every op on the default device, no recomputation, and no error."""


def run_graph(model: Any, inputs: list[Any], operation_fn: Callable[[Any], Any]) -> Any:
    """Keras' own ``Function._run_through_graph`` on ``model`` (not a subclass's
    override): walks the Functional graph once, calling ``operation_fn(op)(*args,
    **kwargs)`` at each node, with ``inputs`` flat in ``model.inputs`` order.

    ``apply.joint_forward`` runs a step's micro-batches and replica copies layer by
    layer with it (global batch statistics); its values are not tensors, so the
    subclasses' per-tensor wrappers must not see them. Checked on Keras 3.15.1.
    Without it the layer-by-layer step would have to re-implement Keras' graph walk."""
    return _method(functional_class(), RUN_THROUGH_GRAPH, "walking a Functional graph")(
        model, inputs, operation_fn=operation_fn)


def standardize_functional_inputs(model: Any, inputs: Any) -> list[Any]:
    """``Functional._standardize_inputs``: a call's inputs (array, list, dict by input
    name) as the flat list, in ``model.inputs`` order and dtypes, that
    ``Functional.call`` hands to its graph. ``apply.joint_forward`` uses it so a
    layer-by-layer step accepts the inputs ``model(x)`` accepts. Checked on Keras
    3.15.1. Without it dict inputs would reach the graph in the wrong order."""
    return list(_method(model, "_standardize_inputs", "a Functional call's inputs")(inputs))


def functional_operation(operation: Any, **call_context: Any) -> Callable[..., Any]:
    """``keras.src.models.functional.operation_fn``: ``operation``'s call with the
    call-context arguments (``training``) that ``Functional.call`` passes to every
    layer that takes them. Checked on Keras 3.15.1. Without it a layer-by-layer step
    would call Dropout and BatchNormalization in inference mode."""
    fn = _private("keras.src.models.functional", "operation_fn",
                  "a layer's call with the training flag")
    return fn(operation, **call_context)


def unpack_singleton(outputs: Any) -> Any:
    """``keras.src.models.functional.unpack_singleton``: a one-element list as its
    element, as ``Functional.call`` returns outputs. Checked on Keras 3.15.1."""
    return _private("keras.src.models.functional", "unpack_singleton",
                    "a Functional call's outputs")(outputs)


T = TypeVar("T", bound=type)


def overrides_run_through_graph(cls: T) -> T:
    """Class decorator for a Functional subclass that overrides ``RUN_THROUGH_GRAPH``:
    checks, when the class is defined, that Keras' Functional has that method with the
    parameters the override takes and that ``Functional.call`` still calls it (see
    ``RUN_THROUGH_GRAPH``), and that the class overrides it."""
    base = functional_class()
    method = getattr(base, RUN_THROUGH_GRAPH, None)
    params = list(inspect.signature(method).parameters) if method is not None else []
    try:
        called = f".{RUN_THROUGH_GRAPH}(" in inspect.getsource(base.call)
    except (OSError, TypeError):  # no source files (a frozen install): the tests check it
        called = True
    if params != ["self", "inputs", "operation_fn", "call_fn"] or not called:
        raise KerasInternalsError(_moved(
            f"Functional.{RUN_THROUGH_GRAPH}(inputs, operation_fn, call_fn), called by "
            f"Functional.call", f"parameters {params}"))
    if RUN_THROUGH_GRAPH not in vars(cls):
        raise TypeError(f"{cls.__name__} is marked as overriding Functional."
                        f"{RUN_THROUGH_GRAPH} but does not define it.")
    return cls


def optimizer_strategy(optimizer: Any) -> Any:
    """``TFOptimizer._distribution_strategy``: the tf.distribute strategy an optimizer
    was created under (None if it has none). Looks through a LossScaleOptimizer.

    ``apply.data_parallel`` keeps an optimizer made inside the model's strategy and
    re-creates one made outside it. Checked on Keras 3.15.1 (TensorFlow backend).
    Without it every optimizer would be re-created, and the object the user passed to
    ``compile`` would never be the one that trains, even when it could be.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return getattr(inner, "_distribution_strategy", None)


def global_norm(values: list[Any]) -> Any:
    """Keras' ``base_optimizer.global_norm``: sqrt of the sum of squares of all values,
    the norm ``clip_by_global_norm`` (``global_clipnorm``) scales by.

    ``apply.clipping`` clips the summed or one-copy gradients with it. Checked on
    Keras 3.15.1. Without the same formula the clipped update would differ from
    Keras' on one device (another dtype handling, another norm for sparse values).
    """
    return _private("keras.src.optimizers.base_optimizer", "global_norm",
                    "the global gradient norm")(values)


def optimizer_built_variables(optimizer: Any) -> list[Any]:
    """``BaseOptimizer._trainable_variables``: the variables an optimizer was built on, in
    the order its slots were made. Looks through a LossScaleOptimizer.

    ``apply.checkpoint`` maps each slot to its weight with it (weight files in one
    device's layout whatever the plan). Checked on Keras 3.15.1. Without it a slot's
    weight would have to be guessed from the slot's name, which repeats across copies.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    try:
        return list(inner._trainable_variables)
    except AttributeError as e:
        raise KerasInternalsError(_moved(
            f"{type(inner).__name__}._trainable_variables (an optimizer's variables)", e)
        ) from e


ALL_REDUCE_SUM_GRADIENTS = "_all_reduce_sum_gradients"
"""The name of ``TFOptimizer._all_reduce_sum_gradients(grads_and_vars)``, which the TF
backend's ``_backend_update_step`` calls in a replica context to sum the gradients
across replicas before the update. ``apply.clipping.keras_all_reduce_off`` replaces
it on one optimizer object (with an identity) while the gradients it passes are
already summed and clipped. Checked on Keras 3.15.1. If Keras renamed it, the
replacement would be a no-op attribute: gradients summed twice (a dp-times too
large update) with no error; ``check_all_reduce_sum_gradients`` catches that."""


def check_all_reduce_sum_gradients(optimizer: Any) -> None:
    """Raise KerasInternalsError unless ``optimizer`` (or the optimizer a
    LossScaleOptimizer wraps) has ``ALL_REDUCE_SUM_GRADIENTS`` taking one argument."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    method = getattr(type(inner), ALL_REDUCE_SUM_GRADIENTS, None)
    params = list(inspect.signature(method).parameters) if method is not None else []
    if params != ["self", "grads_and_vars"]:
        raise KerasInternalsError(_moved(
            f"{type(inner).__name__}.{ALL_REDUCE_SUM_GRADIENTS}(grads_and_vars)",
            f"parameters {params}"))


# --- the functional graph ----------------------------------------------------------------

def layer_graph(model: Any) -> Any | None:
    """The Functional whose layer graph (``_nodes_by_depth``) describes ``model``: the
    model itself (Functional), the Functional a built Sequential keeps inside
    (``inner_functional``), or None (a subclassed model: no graph). Checked on Keras
    3.15.1. Without it the profiler could not tell a subclassed model (profiled by
    tracing alone) from a graph it can walk."""
    if hasattr(model, "_nodes_by_depth"):
        return model
    inner = inner_functional(model)
    return inner if hasattr(inner, "_nodes_by_depth") else None


def has_layer_graph(model: Any) -> bool:
    """Whether ``model`` has a layer graph (``layer_graph(model) is not None``)."""
    return layer_graph(model) is not None


def inner_functional(model: Any) -> Any | None:
    """``Sequential._functional``: the Functional model a built Sequential keeps
    inside (None for other models, or a Sequential not built yet).

    The profiler reads a Sequential's inputs and graph from it. Checked on Keras
    3.15.1. Without it a Sequential model would look like a subclassed one (no
    inputs, no graph): no edges, no repeat detection.
    """
    return getattr(model, "_functional", None)


def nodes_by_depth(functional: Any) -> dict[int, list[Any]]:
    """``Functional._nodes_by_depth``: ``{depth: [Node, ...]}``, depth 0 the output
    nodes, the largest depth the inputs (so ``sorted(..., reverse=True)`` walks from the
    inputs); each Node has ``operation``, ``input_tensors``, ``outputs``, ``is_input``,
    ``arguments``.

    ``apply.placement`` gives every operation of the graph a device with it; the
    profiler's repeat detection walks it. Checked on Keras 3.15.1. Without it
    ``keras.ops`` calls between layers would get no device (they would run on the
    default device, not next to their inputs).
    """
    try:
        return functional._nodes_by_depth
    except AttributeError as e:
        raise KerasInternalsError(_moved("Functional._nodes_by_depth", e)) from e


def keras_history(tensor: Any) -> Any | None:
    """``KerasTensor._keras_history``: ``(operation, node_index, tensor_index)`` of the
    operation that made a symbolic tensor (None for anything else).

    Placement, the profiler's graph and repeat detection find a tensor's producer
    with it; the profiler names model inputs after their InputLayer with it.
    Checked on Keras 3.15.1. Without it no operation would have a producer: every
    ``keras.ops`` call on the default device, and no edges between layers.
    """
    return getattr(tensor, "_keras_history", None)


def producer(tensor: Any) -> Any | None:
    """The operation that made symbolic ``tensor`` (``keras_history(tensor).operation``),
    None when it has no history."""
    history = keras_history(tensor)
    return None if history is None else history.operation


def inbound_nodes(layer: Any) -> list[Any]:
    """``Layer._inbound_nodes``: one Node per call of ``layer`` in symbolic graphs.

    The profiler counts the layer calls it will trace with it (its progress bar).
    Checked on Keras 3.15.1. Without it the count would be one per layer, wrong for
    shared layers.
    """
    return list(getattr(layer, "_inbound_nodes", ()) or ())


def node_call_arguments(node: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``Node.arguments.args`` / ``.kwargs``: the symbolic positional and keyword
    arguments a layer was called with in a Functional graph.

    ``profiler.signature`` replays a block's call on them (``compute_output_spec``) to
    learn the order it calls its sub-layers in. Checked on Keras 3.15.1. Without it a
    block's sub-layers would be listed in the order it made them, which need not be a
    topological order of the profile's graph.
    """
    arguments = getattr(node, "arguments", None)
    if arguments is None or not hasattr(arguments, "args"):
        raise KerasInternalsError(_moved("Node.arguments", AttributeError("arguments")))
    return tuple(arguments.args), dict(arguments.kwargs)


def fill_in_arguments(node: Any, values: dict[int, Any]) -> tuple[tuple[Any, ...],
                                                                   dict[str, Any]]:
    """``Node.arguments.fill_in(values)``: a Functional graph node's call arguments with
    each KerasTensor replaced by ``values[id(tensor)]``, as ``Function._run_through_graph``
    calls the node's operation.

    ``apply.spmd.stages`` runs a model's graph one pipeline stage at a time with it.
    Checked on Keras 3.15.1. Without it a stage would have to rebuild every node's nested
    arguments (lists, dicts, keyword arguments) by hand."""
    arguments = getattr(node, "arguments", None)
    fill_in = getattr(arguments, "fill_in", None)
    if fill_in is None:
        raise KerasInternalsError(_moved("Node.arguments.fill_in", AttributeError("fill_in")))
    args, kwargs = fill_in(values)
    return tuple(args), dict(kwargs)


def functional_outputs(functional: Any, flat: list[Any]) -> Any:
    """A Functional model's outputs from their flat values (in ``functional.outputs``
    order), in the structure its ``call`` returns: ``Function._outputs_struct`` packed,
    then ``unpack_singleton``, as ``Functional.call`` does.

    ``apply.spmd.stages`` gives the loss the outputs of a model run stage by stage.
    Checked on Keras 3.15.1. Without it a model with dict or nested outputs would reach
    the loss as a flat list."""
    import keras

    struct = getattr(functional, "_outputs_struct", None)
    if struct is None:
        raise KerasInternalsError(_moved("Function._outputs_struct",
                                         AttributeError("_outputs_struct")))
    return unpack_singleton(keras.tree.pack_sequence_as(struct, list(flat)))


def replay_symbolically(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``keras.src.backend.compute_output_spec(fn, *args, **kwargs)``: runs ``fn`` on
    backend placeholders standing for the KerasTensors in the arguments (TensorFlow: in
    a scratch FuncGraph), nothing computed and no graph node added.

    ``profiler.signature`` replays a block's ``call`` with it (``Layer.compute_output_spec``
    skips ``call`` when the layer defines ``compute_output_shape``, as keras_hub's blocks
    do). Checked on Keras 3.15.1. Without it a block's sub-layers keep the order it made
    them in.
    """
    fn_spec = _private("keras.src.backend", "compute_output_spec", "the backend's "
                       "symbolic replay")
    return fn_spec(fn, *args, **kwargs)


# --- layer internals ---------------------------------------------------------------------

def analyze_einsum_string(equation: str, bias_axes: str | None, input_shape: Any,
                          output_shape: Any) -> tuple[Any, Any, Any]:
    """``einsum_dense._analyze_einsum_string``: ``(kernel_shape, bias_shape,
    full_output_shape)`` of an EinsumDense layer for an input shape (the private
    function returns two more entries: equations for LoRA, dropped here).

    ``apply.sharded_layers.ShardedEinsumDense`` shards the kernel Keras would build.
    Checked on Keras 3.15.1. Without Keras' own analysis the sharded kernel could have
    another shape than the unsplit layer's, and its weights would not load.
    """
    fn = _private("keras.src.layers.core.einsum_dense", "_analyze_einsum_string",
                  "EinsumDense's kernel and bias shapes")
    kernel_shape, bias_shape, full_output_shape, *_ = fn(equation, bias_axes, input_shape,
                                                         output_shape)
    return kernel_shape, bias_shape, full_output_shape


def get_keras_mask(x: Any) -> Any | None:
    """``keras.src.backend.get_keras_mask``: the Keras mask a tensor carries (None if
    none). Checked on Keras 3.15.1. Without it ``ShardedMultiHeadAttention`` would
    ignore the query's padding mask that the unsplit layer uses."""
    return _private("keras.src.backend", "get_keras_mask", "a tensor's Keras mask")(x)


def set_keras_mask(x: Any, mask: Any) -> None:
    """``keras.src.backend.set_keras_mask``: attach a Keras mask to a tensor. Checked on
    Keras 3.15.1. Without it the sharded attention's output would lose the query mask
    that the unsplit layer passes on to the next layers."""
    _private("keras.src.backend", "set_keras_mask", "attaching a Keras mask")(x, mask)


def drop_unsplit_kernel(layer: Any) -> None:
    """Set ``layer._kernel`` (Dense, EinsumDense, Conv: the variable behind the public
    ``kernel`` property) to None: a sharded layer has shards, not that variable.
    Checked on Keras 3.15.1. Without it reading ``layer.kernel`` on a sharded layer
    would raise AttributeError (the property reads ``_kernel``, which the sharded
    ``build`` never makes) instead of giving None."""
    layer._kernel = None


def drop_unsplit_embeddings(layer: Any) -> None:
    """Set ``Embedding._embeddings`` (behind the public ``embeddings`` property) to None,
    as ``drop_unsplit_kernel`` for an Embedding's table. Checked on Keras 3.15.1."""
    layer._embeddings = None


def conv_causal_padding(layer: Any) -> Any:
    """``Conv1D._compute_causal_padding()``: the left padding of ``padding="causal"``.
    Checked on Keras 3.15.1. Without it a sharded causal Conv1D would pad differently
    from the unsplit one (another output length or a look-ahead)."""
    return _method(layer, "_compute_causal_padding", "a causal Conv1D's padding")()


def batch_norm_moments(layer: Any, inputs: Any, mask: Any = None) -> tuple[Any, Any]:
    """``BatchNormalization._moments(inputs, mask)``: the batch mean and biased variance a
    training call normalises with (over the reduction axes; with a Keras mask over its
    unmasked entries), without moving the moving statistics. Checked on Keras 3.15.1.
    ``apply.spmd.batch_norm`` records them per part under the ``local`` rule and moves the
    moving statistics once per step itself."""
    return _method(layer, "_moments", "a BatchNormalization's batch statistics")(inputs, mask)


class AttentionSettings(NamedTuple):
    """What a MultiHeadAttention was configured with that has no public property
    (``output_shape`` normalized to a tuple or None; the weight arguments as the
    layer's ``add_weight`` keywords)."""

    output_shape: tuple[int, ...] | None
    use_gate: bool
    kernel: dict[str, Any]
    bias: dict[str, Any]


def attention_settings(layer: Any) -> AttentionSettings:
    """A MultiHeadAttention's ``_output_shape``, ``_use_gate`` and its kernel/bias
    initializers, regularizers and constraints (the objects, not their configs).

    ``ShardedMultiHeadAttention.build`` makes its shards with the same weight arguments
    as the unsplit projections and refuses layers it cannot split. Checked on Keras
    3.15.1. Without them the shards would be initialized differently (or lose
    regularization), and a gated attention would be split as if ungated.
    """
    try:
        return AttentionSettings(
            layer._output_shape, bool(getattr(layer, "_use_gate", False)),
            dict(initializer=layer._kernel_initializer, regularizer=layer._kernel_regularizer,
                 constraint=layer._kernel_constraint),
            dict(initializer=layer._bias_initializer, regularizer=layer._bias_regularizer,
                 constraint=layer._bias_constraint))
    except AttributeError as e:
        raise KerasInternalsError(_moved("MultiHeadAttention's weight settings", e)) from e


def build_attention(layer: Any, rank: int) -> None:
    """``MultiHeadAttention._build_attention(rank)``: makes the softmax, dropout and the
    dot-product equations for inputs of ``rank`` (4: batch, seq, heads, dim).
    Checked on Keras 3.15.1. Without it ``attention_scores`` would have no equations
    to run."""
    _method(layer, "_build_attention", "the attention equations")(rank)


def attention_mask(layer: Any, query: Any, value: Any, **masks: Any) -> Any:
    """``MultiHeadAttention._compute_attention_mask(query, value, query_mask=,
    value_mask=, key_mask=, attention_mask=, use_causal_mask=)``: the combined mask.
    Checked on Keras 3.15.1. Without it the sharded attention would not apply padding
    or causal masks as the unsplit layer does."""
    return _method(layer, "_compute_attention_mask", "the combined attention mask")(
        query, value, **masks)


def attention_scores(layer: Any, query: Any, key: Any, value: Any, mask: Any, training: Any,
                     return_attention_scores: bool) -> tuple[Any, Any]:
    """``MultiHeadAttention._compute_attention``: ``(output, scores)`` of scaled
    dot-product attention over projected ``(batch, seq, heads, dim)`` tensors, with the
    layer's softmax, dropout and scale. Checked on Keras 3.15.1. Without it the
    sharded attention would compute its heads with another scale or dropout."""
    return _method(layer, "_compute_attention", "scaled dot-product attention")(
        query, key, value, mask, training, return_attention_scores)


def wrap_attention_core(layer: Any,
                        wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace, on this instance, the attention core of a MultiHeadAttention or
    GroupedQueryAttention (``_compute_attention(query, key, value, attention_mask,
    training, ...)``: the scores QK^T, the masked softmax, its dropout, scores x V over
    the projected Q, K, V) by ``wrap(core)``, where ``core`` takes the same arguments and
    returns the attention output alone.

    ``apply.recompute`` passes ``tf.recompute_grad``'s wrapper: only the core is re-run in
    the backward pass (Megatron's selective recomputation). A call that asks for the
    attention scores (MultiHeadAttention's ``return_attention_scores`` argument,
    GroupedQueryAttention's ``_return_attention_scores``) runs the original core (the
    scores are an output to keep); otherwise the scores returned are None, which
    ``call`` then drops. ``layer.call`` and ``ShardedMultiHeadAttention`` (through
    ``attention_scores``) both look the method up on the instance. Checked on Keras
    3.15.1. Without it the projections' activations would be recomputed as well (the
    whole layer under ``tf.recompute_grad``).
    """
    original = _method(layer, "_compute_attention", "the attention core")
    signature = inspect.signature(original)
    wrapped = wrap(lambda *args, **kwargs: original(*args, **kwargs)[0])

    def compute_attention(*args: Any, **kwargs: Any) -> Any:
        given = signature.bind(*args, **kwargs).arguments
        if given.get("return_attention_scores") or getattr(
                layer, "_return_attention_scores", False):
            return original(*args, **kwargs)
        return wrapped(*args, **kwargs), None

    layer._compute_attention = compute_attention


def attention_core_is_wrapped(layer: Any) -> bool:
    """True when ``wrap_attention_core`` replaced ``layer``'s attention core."""
    return "_compute_attention" in vars(layer)


ATTENTION_PROJECTIONS = ("query", "key", "value", "output")


def set_attention_projection(layer: Any, part: str, entry: Any) -> None:
    """Set ``MultiHeadAttention._{part}_dense`` (``part`` in ``ATTENTION_PROJECTIONS``):
    the sub-layers Keras saves the projections' weights under (``query_dense``, ... are
    the public read-only views). ``ShardedMultiHeadAttention`` puts there entries that
    save and load the unsplit weights. Checked on Keras 3.15.1. Without them a sharded
    attention's weight file would not match the unsplit layer's (weights lost)."""
    if part not in ATTENTION_PROJECTIONS:
        raise ValueError(f"part must be one of {ATTENTION_PROJECTIONS}, got {part!r}")
    setattr(layer, f"_{part}_dense", entry)


def attention_projection(layer: Any, part: str) -> Any:
    """``MultiHeadAttention._{part}_dense`` or ``GroupedQueryAttention._{part}_dense``
    (``part`` in ``ATTENTION_PROJECTIONS``): the EinsumDense of that projection (grouped
    query attention has no public view of them). ``apply.spmd.rank_layers`` runs a rank's
    projections itself, with g between the output projection's product and its bias.
    Checked on Keras 3.15.1. Without it a rank could not hold its heads' projections."""
    if part not in ATTENTION_PROJECTIONS:
        raise ValueError(f"part must be one of {ATTENTION_PROJECTIONS}, got {part!r}")
    try:
        return getattr(layer, f"_{part}_dense")
    except AttributeError as e:
        raise KerasInternalsError(_moved(f"the attention's {part} projection", e)) from e


def grouped_attention_scores(layer: Any, query: Any, key: Any, value: Any, mask: Any,
                             training: Any, return_attention_scores: bool
                             ) -> tuple[Any, Any]:
    """``GroupedQueryAttention._compute_attention(query, key, value, attention_mask=,
    training=)`` over projected (batch, seq, heads, dim) tensors whose key/value heads are
    repeated to the query heads: ``(output, scores)`` with the layer's scale, softmax and
    dropout (``_return_attention_scores`` set as its ``call`` sets it; the scores are None
    when not asked for). Checked on Keras 3.15.1. Without it a rank's heads would be
    computed with another scale or dropout than the unsplit layer's."""
    try:
        layer._return_attention_scores = return_attention_scores
        core = layer._compute_attention
    except AttributeError as e:
        raise KerasInternalsError(_moved("grouped-query attention's core", e)) from e
    return core(query, key, value, attention_mask=mask, training=training)


def set_untracked_attribute(layer: Any, name: str, value: Any) -> None:
    """Set ``layer.<name>`` without Keras' tracker (``object.__setattr__``) and point
    TensorFlow's attribute dependency of that name (``Trackable._track_trackable``, the
    dict and list behind checkpoints) at ``value`` too. ``apply.sharded_attention_block``
    replaces an attention block's projections after the block was built (Keras' tracker is
    locked). Checked on Keras 3.15.1 / TensorFlow 2.21. Without it TensorFlow's dependency
    would keep the unsplit projection (and its weights) alive."""
    object.__setattr__(layer, name, value)
    track = getattr(layer, "_track_trackable", None)
    if track is not None:
        track(value, name=name, overwrite=True)


def serialize_as(cls: type, like: type) -> None:
    """Serialize ``cls`` under ``like``'s registered name (``object_registration.
    GLOBAL_CUSTOM_NAMES[cls]``), leaving the name's class, the one a saved model is loaded
    as, ``like``. ``apply.expert_parallel`` saves its twin of ``tfplan.layers.
    MixtureOfExperts`` as the user's layer. Checked on Keras 3.15.1. Without it
    ``keras.models.load_model`` of a wrapped model could not find the twin's bare class
    name."""
    names = _private("keras.src.saving.object_registration", "GLOBAL_CUSTOM_NAMES",
                     "the registered names of serializable classes")
    get_name = _private("keras.src.saving.object_registration", "get_registered_name",
                        "a class's registered name")
    names[cls] = get_name(like)


def build_arguments(layer: Any) -> dict[str, Any]:
    """``Layer._build_shapes_dict``: the shape arguments ``layer.build`` was called with,
    by parameter name (``{"input_shape": (None, 8)}``; MultiHeadAttention's
    ``{"query_shape": ..., "value_shape": ...}``), recorded by Keras' build wrapper.

    ``apply.blocks`` builds a block's sharded sub-layer with the arguments its unsplit
    twin was built with: a block's ``build`` (keras_hub's) calls ``sub.build(shape)``
    itself, so nothing else records them. Checked on Keras 3.15.1. Without it a
    sub-layer could only be built by calling the block again, where its symbolic call
    may never run the sub-layer's ``call``."""
    if not hasattr(layer, "_build_shapes_dict"):
        raise KerasInternalsError(_moved("Layer._build_shapes_dict (a layer's build "
                                         "arguments)", AttributeError("_build_shapes_dict")))
    shapes = layer._build_shapes_dict
    if not layer.built or shapes is None:
        raise PlannerError(f"Layer {layer.name!r} ({type(layer).__name__}) was not built "
                           "through its build() method, so the shapes it was built for are "
                           "unknown.")
    return dict(shapes)


def replace_tracked_layer(parent: Any, old: Any, new: Any) -> None:
    """``parent._tracker.replace_tracked_value("layers", old, new)``: sub-layer ``new``
    takes ``old``'s place in the layers ``parent`` tracks (``_layers``, the list behind
    ``weights``, ``variables``, ``_flatten_layers``), at the same position, even after
    ``parent`` was built (Keras then refuses new state, ``Tracker.lock``).

    ``apply.blocks`` swaps a block's sub-layer for its sharded twin in place. Checked on
    Keras 3.15.1. Without it the block would keep tracking the unsplit sub-layer (its
    weights trained and saved instead of the shards), or refuse the new one."""
    tracker = getattr(parent, "_tracker", None)
    replace = getattr(tracker, "replace_tracked_value", None)
    if replace is None:
        raise KerasInternalsError(_moved("Layer._tracker.replace_tracked_value (a layer's "
                                         "tracked sub-layers)", AttributeError("_tracker")))
    replace("layers", old, new)


def move_variable(variable: Any, device: str) -> None:
    """Re-create ``variable``'s storage (a ``keras.Variable`` of the TensorFlow backend:
    its ``tf.Variable``, ``Variable._value``) on ``device``, with its value, name,
    trainability, aggregation and synchronization, through Keras' own
    ``Variable._initialize`` (which takes a ready ``tf.Variable``).

    ``apply.blocks`` moves the weights of a nested model's layers to the stages a plan
    puts them on: a nested model (a keras_hub backbone) is re-created whole from its
    config, whose constructor builds every layer in one device scope. Checked on Keras
    3.15.1. Without it those weights would stay on the first stage's device, read
    across devices at every step."""
    import tensorflow as tf

    old = getattr(variable, "_value", None)
    initialize = getattr(variable, "_initialize", None)
    if old is None or initialize is None:
        raise KerasInternalsError(_moved("keras.Variable._value / _initialize (a "
                                         "variable's storage)", AttributeError("_value")))
    with tf.init_scope(), tf.device(device):
        new = tf.Variable(old.read_value(), dtype=old.dtype, trainable=old.trainable,
                          name=variable.name, aggregation=old.aggregation,
                          synchronization=old.synchronization)
    initialize(new)


def free_storage(variable: Any) -> None:
    """Give a ``keras.Variable`` an empty ``tf.Variable`` (``Variable._value``) on the same
    device, freeing its values; Keras keeps its ``shape`` and ``dtype`` (its own
    attributes), so layers and symbolic calls still see the weight's shape.

    ``apply.spmd.zero3`` frees each device's whole copy of the weights it trains as
    shards (every read of them in a step goes through ``keras.StatelessScope``). Checked on
    Keras 3.15.1. Without it each device would hold a whole copy beside the shards."""
    import tensorflow as tf

    old = getattr(variable, "_value", None)
    if old is None:
        raise KerasInternalsError(_moved("keras.Variable._value (a variable's storage)",
                                         AttributeError("_value")))
    with tf.init_scope(), tf.device(old.device):
        variable._value = tf.Variable(tf.zeros((0,), old.dtype), trainable=False,
                                      name=variable.name)


def place_operations(functional: Any, wrap: Callable[[Any, Callable[..., Any]],
                                                     Callable[..., Any]]) -> None:
    """Make this instance of a Functional model run each operation of its graph through
    ``wrap(operation, call)`` (a call of the operation, e.g. under its ``tf.device``), by
    an instance attribute over ``RUN_THROUGH_GRAPH``, which ``Functional.call`` looks up
    on the instance. Its class (a keras_hub backbone's, which names its weight-file
    entries) stays.

    ``apply.blocks`` places the layers of a nested model whose layers a plan puts on
    several devices. Checked on Keras 3.15.1 (``overrides_run_through_graph``'s check
    of the method's parameters runs here too). Without it every operation of the nested
    model would run on the device of its first layer."""
    overrides_run_through_graph(type("_Check", (functional_class(),),
                                     {RUN_THROUGH_GRAPH: lambda self: None}))
    original = getattr(functional, RUN_THROUGH_GRAPH)

    def run(inputs: Any, operation_fn: Any = lambda op: op, call_fn: Any = None) -> Any:
        if call_fn is not None:  # clone_model(..., call_function=...): not a forward pass
            return original(inputs, operation_fn=operation_fn, call_fn=call_fn)
        return original(inputs, operation_fn=lambda op: wrap(op, operation_fn(op)))

    setattr(functional, RUN_THROUGH_GRAPH, run)


# --- TensorFlow ----------------------------------------------------------------------------

class LocalDevice(NamedTuple):
    """One local device as TensorFlow's runtime reports it."""

    name: str  # "/device:GPU:0"
    device_type: str  # "GPU", "CPU"
    memory_limit_bytes: int  # what TensorFlow's allocator may use (0 if not reported)


def local_devices() -> tuple[LocalDevice, ...]:
    """``device_lib.list_local_devices()`` (TensorFlow's ``client.device_lib``): every
    local device with its allocator memory limit, the one TensorFlow API that reports
    a GPU's usable memory.

    ``apply.auto`` and ``profiler.hardware`` size the cluster's device memory with it.
    Checked on TensorFlow 2.21.0. Without it a GPU's memory would come from a preset
    (another card's figure): plans that do not fit or leave memory unused.
    """
    list_local = _private("tensorflow.python.client.device_lib", "list_local_devices",
                          "the local devices and their memory limits")
    return tuple(LocalDevice(d.name, d.device_type, int(d.memory_limit or 0))
                 for d in list_local())


def function_graph(graph: Any, name: str) -> Any:
    """The FuncGraph of function ``name`` in ``graph``'s function library or that of a
    graph it is nested in (``Graph._get_function(name).graph``, walking
    ``FuncGraph.outer_graph``).

    ``profiler.control_flow`` reads the body and condition of a ``While`` op (its
    ``body``/``cond`` attributes name them) and the function a ``PartitionedCall`` runs
    (its ``f``) to count their ops with static shapes. The public route,
    ``graph.as_graph_def().library``, gives FunctionDefs without shapes; turning one
    back into a graph needs ``function_def_to_graph``, private too. Checked on
    TensorFlow 2.21.0. Without it a While loop (an LSTM, ``keras.ops.scan``) and a
    function call (a grouped convolution, which Keras runs as an XLA-compiled
    ``tf.function``) would have no FLOPs.
    """
    g = graph
    while g is not None:
        found = _method(g, "_get_function", "a graph's function library")(name)
        if found is not None:
            try:
                return found.graph
            except AttributeError as e:
                raise KerasInternalsError(_moved("AtomicFunction.graph (a function's "
                                                 "FuncGraph)", e)) from e
        g = getattr(g, "outer_graph", None)
    return None


def release_to(copy: Any, owner: Any) -> None:
    """Drop ``copy``'s own storage (a ``keras.Variable`` of the TensorFlow backend) and make
    it a view of ``owner`` (a variable of the same shape and dtype): reads give
    ``owner``'s value, assignments write ``owner``.

    Keras 3 keeps a variable's ``tf.Variable`` in ``Variable._value``; with ``_value``
    None its ``value`` property calls ``_initializer(shape, dtype)`` (the path of a
    variable made in a ``StatelessScope``, whose value comes later), and ``assign``
    calls ``_direct_assign(value)`` outside a ``StatelessScope``. ``apply.zero3`` releases
    every data-parallel copy but the owner's (ZeRO-3: one persistent copy of each
    weight), so the layers keep their variables (and weight files, ``get_weights``,
    ``set_weights`` their behaviour) while only the owner's copy holds memory. Checked
    on Keras 3.15.1. Without it the non-owner copies would each keep the whole weight.
    """
    for attr in ("_value", "_initializer", "_direct_assign"):
        if not hasattr(copy, attr):
            raise KerasInternalsError(_moved(f"keras.Variable.{attr} (a variable's storage)",
                                             AttributeError(attr)))
    if tuple(copy.shape) != tuple(owner.shape) or copy.dtype != owner.dtype:
        raise PlannerError(f"Variable {copy.path!r} {tuple(copy.shape)} {copy.dtype} cannot "
                           f"view {owner.path!r} {tuple(owner.shape)} {owner.dtype}.")
    copy._value = None
    copy._initializer = lambda shape=None, dtype=None: owner.value
    copy._direct_assign = lambda value: owner.assign(value)


def holds_storage(variable: Any) -> bool:
    """Whether a ``keras.Variable`` holds a value of its own (``Variable._value``; False
    after ``release_to``, or for a variable made in a ``StatelessScope``). Checked on
    Keras 3.15.1."""
    if not hasattr(variable, "_value"):
        raise KerasInternalsError(_moved("keras.Variable._value (a variable's storage)",
                                         AttributeError("_value")))
    return variable._value is not None


_CALL_ATTRS = {"PartitionedCall": ("f",), "StatefulPartitionedCall": ("f",),
               "While": ("body", "cond"), "StatelessWhile": ("body", "cond"),
               "If": ("then_branch", "else_branch"),
               "StatelessIf": ("then_branch", "else_branch")}


def eager_function_names() -> set[str]:
    """The names of every function in the eager context's library
    (``context.list_function_names``, private). ``apply.audit`` takes the difference before
    and after one training step to find the functions that step traced. Checked on
    TensorFlow 2.21.0."""
    from tensorflow.python.eager import context

    ctx = context.context()
    names = _method(ctx, "list_function_names", "the eager context's function library")
    return set(names())


def traced_graphs(names: set[str]) -> dict[str, Any]:
    """{function name: its graph with static shapes} for the eager library's functions
    ``names`` and every function they call (``Context.get_function_def`` and
    ``function_def_to_graph``, private; the public ``FunctionDef`` has no shapes, and the
    partitioned graphs TensorFlow runs carry none either). ``apply.audit`` sizes the
    tensors a step sends by them. Checked on TensorFlow 2.21.0."""
    from tensorflow.python.eager import context

    to_graph = _private("tensorflow.python.framework.function_def_to_graph",
                        "function_def_to_graph", "a FunctionDef back to a graph with shapes")
    ctx = context.context()
    get = _method(ctx, "get_function_def", "a function's definition in the eager library")
    out: dict[str, Any] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        try:
            graph = to_graph(get(name))
        except Exception:  # noqa: BLE001 -- a function that does not import has no shapes
            out[name] = None
            continue
        out[name] = graph
        for op in graph.get_operations():
            todo += called_function_names(op)
    return out


def called_function_names(op: Any) -> list[str]:
    """The functions ``op`` calls (a PartitionedCall's ``f``, a While's body and condition,
    an If's branches); [] for any other op."""
    out = []
    for attr in _CALL_ATTRS.get(op.type, ()):
        try:
            out.append(op.get_attr(attr).name)
        except (ValueError, AttributeError):
            continue
    return out


def called_function_graphs(op: Any) -> list[Any]:
    """The Python graphs (``FuncGraph``, with the static shapes their tracing set) of the
    functions ``op`` calls, from its graph's private ``_functions`` table of
    ``AtomicFunction``s (``.graph``); [] where a called function has none there.
    ``apply.audit`` sizes a step's tensors by them when the library's function definitions
    leave a shape unknown. Checked on TensorFlow 2.21.0."""
    table = getattr(op.graph, "_functions", None)
    if table is None:
        raise KerasInternalsError(_moved("FuncGraph._functions (the functions a graph "
                                          "calls)", AttributeError("_functions")))
    out = []
    for name in called_function_names(op):
        graph = getattr(table.get(name), "graph", None)
        if graph is not None:
            out.append(graph)
    return out


def runtime_tensor_bytes(dump_root: str) -> dict[tuple[str, int], int]:
    """{(op name, output slot): bytes} of every op output a graph (a ``tf.function`` and
    the functions it calls) produced while ``tf.debugging.experimental.enable_dump_debug_info
    (dump_root, tensor_debug_mode="SHAPE")`` was on: the shapes the tensors had when they
    ran, read back through the debugger's private ``DebugDataReader``
    (``graph_execution_traces``; SHAPE mode records [tensor id, dtype enum, rank, elements,
    dims...] per output). ``apply.audit`` sizes the tensors a step sends by them: traced
    shapes may leave dimensions unknown. The last record of a name wins. Checked on
    TensorFlow 2.21.0."""
    import tensorflow as tf

    reader_module = importlib.import_module("tensorflow.python.debug.lib.debug_events_reader")
    reader_class = getattr(reader_module, "DebugDataReader", None)
    if reader_class is None:
        raise KerasInternalsError(_moved("tensorflow.python.debug.lib.debug_events_reader."
                                         "DebugDataReader (the debugger's dump reader)",
                                         AttributeError("DebugDataReader")))
    out: dict[tuple[str, int], int] = {}
    with reader_class(dump_root) as reader:
        reader.update()
        for trace in reader.graph_execution_traces():
            value = reader.graph_execution_trace_to_tensor_value(trace)
            if value is None or len(value) < 4:
                continue
            try:
                itemsize = tf.dtypes.as_dtype(int(value[1])).size
            except (TypeError, ValueError):
                continue
            out[(trace.op_name, int(trace.output_slot))] = int(value[3]) * itemsize
    return out


class RunMetadata:
    """What ``collect_run_metadata`` collected: ``metadata`` (a RunMetadata proto) once the
    block has ended."""

    metadata: Any = None


@contextlib.contextmanager
def collect_run_metadata() -> Iterator[RunMetadata]:
    """A context manager collecting the eager context's run metadata (the partitioned graphs
    of every function instantiated inside it: ``context.enable_run_metadata`` /
    ``export_run_metadata``, private), cleared first. ``apply.audit`` reads the transfers
    TensorFlow placed between devices from them. Checked on TensorFlow 2.21.0."""
    from tensorflow.python.eager import context

    ctx = context.context()
    for name in ("enable_run_metadata", "export_run_metadata", "disable_run_metadata"):
        _method(ctx, name, "the eager context's run metadata")
    out = RunMetadata()
    ctx.enable_run_metadata()
    ctx.export_run_metadata()  # clears what an earlier collection left
    try:
        yield out
        out.metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()


@contextlib.contextmanager
def without_replica_sum(optimizer: Any) -> Iterator[None]:
    """While tracing ``apply_gradients``: the TF backend optimizer's
    ``_all_reduce_sum_gradients`` (the sum over ``tf.distribute`` replicas) left out.

    With no strategy, that sum is the default replica context's identity, one ``IdentityN``
    over every gradient created with no device, which TensorFlow places on the first one:
    each device's gradients would travel there and back. The SPMD engine (``apply.spmd``)
    has summed them already with collectives. Checked on Keras 3.15.1. Without it, a data-
    parallel step sends every gradient through device 0, a hub the plan does not price."""
    target = getattr(optimizer, "inner_optimizer", optimizer)
    _method(target, "_all_reduce_sum_gradients", "the replicas' gradient sum")
    target._all_reduce_sum_gradients = lambda grads_and_vars: grads_and_vars
    try:
        yield
    finally:
        del target._all_reduce_sum_gradients


def on_gradient_path(tensor: Any) -> bool:
    """Whether an active ``tf.GradientTape`` records ``tensor`` (it depends on a watched
    variable or tensor): TensorFlow's ``record.should_record_backprop``. ``apply.spmd``'s
    recomputation passes a tensor no tape records (the model's input) to
    ``tf.recompute_grad`` as a constant, so its backward computes no gradient for it (nor
    the tensor-parallel all-reduce of that gradient). Checked on TensorFlow 2.21.0."""
    should_record = _private("tensorflow.python.eager.record", "should_record_backprop",
                             "whether a gradient tape records a tensor")
    return bool(should_record([tensor]))


def uses_weight_decay(optimizer: Any, variable: Any) -> bool:
    """``BaseOptimizer._use_weight_decay(variable)``: whether the optimizer's weight decay
    applies to ``variable`` (False where ``exclude_from_weight_decay`` named it or a
    substring of its name). ``apply.spmd.zero`` gives a weight's shards the same rule.
    Checked on Keras 3.15.1."""
    target = getattr(optimizer, "inner_optimizer", optimizer)
    return bool(_method(target, "_use_weight_decay", "the weight-decay exclusions")(variable))


def compiled_loss(model: Any, y: Any, y_pred: Any, sample_weight: Any) -> Any:
    """``Trainer._compile_loss(y, y_pred, sample_weight)``: the loss given to ``compile``
    alone, reduced as Keras reduces it (masks and sample weights applied), or None when
    none was given. Checked on Keras 3.15.1. The SPMD engine (``apply.spmd``) adds each
    device copy's own added losses to it; without it it would add the wrapped model's
    (every copy's) instead."""
    loss = getattr(model, "_compile_loss", None)
    return None if loss is None else loss(y, y_pred, sample_weight)


def added_loss(model: Any, value: Any) -> Any:
    """``Trainer._aggregate_additional_loss(value)``: an ``add_loss`` term as the train
    step adds it (cast, summed). Checked on Keras 3.15.1. Without it the SPMD engine's
    added losses could differ in dtype or reduction from one device's."""
    return _method(model, "_aggregate_additional_loss", "an added loss's reduction")(value)


def compiled_metrics(model: Any) -> Any:
    """``Trainer._compile_metrics``: the metrics given to ``compile`` (None without any).
    Checked on Keras 3.15.1. The SPMD engine updates them part by part on each replica's
    device; without it the metrics would see one device's concatenated outputs (a hub)."""
    return getattr(model, "_compile_metrics", None)


def flatten_layers(layer: Any) -> list[Any]:
    """``Layer._flatten_layers(include_self=False, recursive=True)``: every sub-layer at
    any depth, in tracking order. Checked on Keras 3.15.1. The SPMD engine finds the rank
    twins inside a device's copy with it; without it split weights would be read whole."""
    return list(_method(layer, "_flatten_layers", "a layer's sub-layers")(
        include_self=False, recursive=True))
