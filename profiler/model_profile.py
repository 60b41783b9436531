"""The profiler's output value: ``LayerProfile`` and ``ModelProfile``.

Pipeline position: ``profiler`` builds a ModelProfile from a Keras model; the
planner reads it (and never reaches back into TensorFlow). This module imports
no TensorFlow, so the planner can load a saved profile on any machine.

All sizes are bytes and all work is FLOPs (2 per multiply-add), measured for
``ModelProfile.batch_size`` samples; ``per_sample`` helpers divide by it.

Per layer (JSON keys are the field names):

* ``params``, ``trainable_params`` (and ``non_trainable_params`` = the difference,
  written to JSON only); ``param_bytes``: every variable in its own dtype -- the
  float32 master weights under mixed precision -- of which
  ``trainable_param_bytes`` are trainable;
* ``compute_weight_bytes``: the low-precision copies of the weights the layer
  casts for compute under mixed precision (0 in float32);
* ``grad_bytes`` (one gradient per trainable variable, in its dtype) and
  ``optimizer_bytes`` (``profiler.optimizer_slots``);
* ``activation_bytes``: the layer's output tensors; ``activation_saved_bytes``:
  the forward tensors the layer produces that its own or later gradient ops
  read (kept alive until the backward pass); ``input_bytes``: the tensors its
  calls receive (a tensor passed twice to one call, as self-attention's query and
  value, once). All in the dtype the layer computes in;
* ``flops_fwd``/``flops_bwd`` from the ops the layer creates and the gradient
  ops of those (``profiler.op_flops``); ``not_counted`` names each op with no
  formula as "op name (OpType)"; of those, ``matmul_flops_fwd``/``_bwd`` are in
  contractions (``profiler.op_flops.MATMUL_OPS``: MatMul, BatchMatMul, Einsum,
  Conv and their backprops), and ``memory_traffic_bytes_fwd``/``_bwd`` are the
  bytes every other op reads and writes (inputs + outputs; views and variable
  reads move nothing): the two sides of the cost model's roofline;
* ``groups``: a convolution's feature groups (``Conv2D(groups=g)``; 1 otherwise):
  ``apply`` splits only convolutions with groups=1, so the planner offers the others
  no tensor-parallel split;
* ``attention_core_flops_fwd``, ``attention_core_saved_bytes``, ``attention_kv_bytes``:
  an attention layer's core -- scores, softmax, dropout, context -- found in its ops
  (``profiler.attention_core``): its forward FLOPs, the saved bytes only it holds, the
  projected keys and values it reads; ``attention_kv_heads``: the layer's key/value
  heads (MultiHeadAttention's heads, GroupQueryAttention's key/value heads). 0 elsewhere;
* ``calls``: how many times the model calls the layer (a shared layer's numbers
  are the sum over its calls); ``inputs``: the layers that feed it;
* ``base_type``: the Keras layer class a subclass derives from (``MultiHeadAttention``
  for keras_hub's ``CachedMultiHeadAttention``; "" when ``type`` is Keras' own or a
  plain ``keras.layers.Layer``); ``kind`` is it, or ``type``;
* ``block``: the outermost block (``profiler.signature.is_block``: a custom layer with
  sub-layers, e.g. a keras_hub transformer block) this entry belongs to, "" for a
  top-level layer. A block's own entry has the block's own weights and the ops of its
  ``call`` outside any sub-layer; its sub-layers follow as ``block/sub`` entries.
  Pipeline stages never cut a block (``planner.partition``);
* ``opaque``: why the planner cannot see into this layer (a custom layer that
  multiplies weights it owns itself, not through Keras layers it could split), ""
  otherwise; ``ModelProfile.opaque_blocks`` lists them;
* ``attention_heads``: a custom attention block's query heads (keras_hub's
  ``LlamaAttention``: ``profiler.attention_blocks``), whose ``attention_kv_heads`` are its
  key/value heads: the planner splits it by heads as a whole, its projections and core
  with it (its sub-layers' entries follow it); 0 for every other layer.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field as dc_field
from typing import Any, Mapping

from tfplan.core.errors import SchemaError
from tfplan.core.schema import SCHEMA_VERSION, check_version, field



def _strings(values: list, path: str) -> tuple[str, ...]:
    if not all(isinstance(v, str) for v in values):
        raise SchemaError(f"{path} is {values!r:.80}; expected a list of strings.")
    return tuple(values)

@dataclass(frozen=True)
class LayerProfile:
    """One layer's costs for ``ModelProfile.batch_size`` samples."""

    name: str
    type: str
    params: int
    trainable_params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # bytes of the layer's output tensor(s)
    flops_fwd: int
    flops_bwd: int
    inputs: tuple[str, ...] = ()  # names of the layers that feed this one
    not_counted: tuple[str, ...] = ()  # what has no FLOP formula (never silently zero)
    trainable_param_bytes: int = 0  # the trainable share of param_bytes
    compute_weight_bytes: int = 0  # low-precision weight copies made for compute
    activation_saved_bytes: int = 0  # forward tensors kept for the backward pass
    input_bytes: int = 0  # tensors the layer's calls receive (each once per call)
    # of those, the floating-point ones: the inputs a gradient flows back into (a mask or
    # token ids has none); -1: not recorded (profiles made before it), read as input_bytes
    float_input_bytes: int = -1
    calls: int = 1  # times the model calls this layer (numbers are summed over calls)
    matmul_flops_fwd: int = 0  # the share of flops_fwd in contractions (MatMul, Einsum, Conv)
    matmul_flops_bwd: int = 0
    memory_traffic_bytes_fwd: int = 0  # bytes read + written by the other ops
    memory_traffic_bytes_bwd: int = 0
    groups: int = 1  # a convolution's feature groups (1 for every other layer)
    # the tensor-parallel splits this layer's configuration rules out at any degree
    # (``profiler.split_rules``: channels-first convolutions, an EinsumDense without a
    # single kernel axis to cut, gated attention, LoRA or quantized weights)
    refused_splits: tuple[str, ...] = ()
    # measured forward/backward seconds for ModelProfile.measured_batch_size samples
    # on ModelProfile.measured_device (``profiler.calibrate``); None: not measured
    measured_fwd_s: float | None = None
    measured_bwd_s: float | None = None
    # output shape per sample (batch dimension dropped, None for a dynamic one); None:
    # unknown (``profiler.signature.output_shape``). Part of the structure a plan matches.
    output_shape: tuple[int | None, ...] | None = None
    # attention layers only (0 elsewhere and in profiles written before these existed):
    # the attention core (scores QK^T, softmax, its dropout, scores x V), for the profile
    # batch -- its forward FLOPs (what Megatron's selective recomputation re-runs), the
    # saved bytes it alone holds (softmax output, dropout mask and output: what selective
    # recomputation frees; Korthikanti et al., 2022, Sec. 4.1: 5 a s^2 b), and the bytes of
    # the keys and values it reads (what context parallelism exchanges between ranks)
    attention_core_flops_fwd: int = 0
    attention_core_saved_bytes: int = 0
    attention_kv_bytes: int = 0
    # an attention layer's key/value heads (MultiHeadAttention: num_heads;
    # GroupQueryAttention: num_key_value_heads; 0 elsewhere): a GroupQueryAttention
    # split by heads needs the tensor-parallel degree to divide it (``profiler.comm``)
    attention_kv_heads: int = 0
    base_type: str = ""  # the Keras layer class a subclass derives from ("": type is it)
    block: str = ""  # the outermost block this entry is part of ("": top level)
    opaque: str = ""  # why the planner cannot see into this layer ("": it can)
    # a custom attention block's query heads (``profiler.attention_blocks``: split by heads
    # as a whole, its projections and core with it); 0 for every other layer
    attention_heads: int = 0
    # mixture-of-experts layers only (``profiler.moe``; 0 elsewhere): E experts, top_k
    # chosen per token, the parameters in the stacked expert weights (what expert
    # parallelism divides), the capacity factor (0.0: none, no token dropped), the tokens
    # routed per profile batch (T), the bytes one direction of the all-to-all carries for
    # them (dispatch: T k d x activation bytes; the combine carries as much back), the
    # routed experts' forward FLOPs (T k per-token expert FLOPs; part of flops_fwd), and
    # the forward FLOPs the layer as written executes in its experts when it computes
    # more than the routed work (a block running every expert on every token; 0 otherwise)
    moe_experts: int = 0
    moe_top_k: int = 0
    moe_expert_params: int = 0
    moe_capacity_factor: float = 0.0
    moe_tokens: int = 0
    moe_dispatch_bytes: int = 0
    moe_expert_flops_fwd: int = 0
    moe_executed_flops_fwd: int = 0

    @property
    def is_moe(self) -> bool:
        """A mixture-of-experts layer (``profiler.moe``)."""
        return self.moe_experts > 0

    @property
    def kind(self) -> str:
        """The Keras layer class this layer is or derives from (``base_type`` or ``type``):
        what the planner's split rules go by."""
        return self.base_type or self.type

    @property
    def has_op_classes(self) -> bool:
        """Whether the contraction / memory-traffic split was recorded. Profiles written
        before it existed have both 0 while flops are not: all their FLOPs are then
        priced as contractions."""
        return bool(self.matmul_flops_fwd or self.matmul_flops_bwd
                    or self.memory_traffic_bytes_fwd or self.memory_traffic_bytes_bwd
                    or not (self.flops_fwd or self.flops_bwd))

    @property
    def non_trainable_params(self) -> int:
        return self.params - self.trainable_params

    @property
    def state_bytes(self) -> int:
        """Weights (and compute copies) + gradients + optimizer state: what a replica holds."""
        return self.param_bytes + self.compute_weight_bytes + self.grad_bytes + \
            self.optimizer_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "type": self.type, "params": self.params,
            "trainable_params": self.trainable_params, "param_bytes": self.param_bytes,
            "grad_bytes": self.grad_bytes, "optimizer_bytes": self.optimizer_bytes,
            "activation_bytes": self.activation_bytes, "flops_fwd": self.flops_fwd,
            "flops_bwd": self.flops_bwd, "inputs": list(self.inputs),
            "not_counted": list(self.not_counted),
            "non_trainable_params": self.non_trainable_params,
            "trainable_param_bytes": self.trainable_param_bytes,
            "compute_weight_bytes": self.compute_weight_bytes,
            "activation_saved_bytes": self.activation_saved_bytes,
            "input_bytes": self.input_bytes, "float_input_bytes": self.float_input_bytes,
            "calls": self.calls,
            "matmul_flops_fwd": self.matmul_flops_fwd, "matmul_flops_bwd": self.matmul_flops_bwd,
            "memory_traffic_bytes_fwd": self.memory_traffic_bytes_fwd,
            "memory_traffic_bytes_bwd": self.memory_traffic_bytes_bwd,
            "groups": self.groups, "measured_fwd_s": self.measured_fwd_s,
            "measured_bwd_s": self.measured_bwd_s,
            "attention_core_flops_fwd": self.attention_core_flops_fwd,
            "attention_core_saved_bytes": self.attention_core_saved_bytes,
            "attention_kv_bytes": self.attention_kv_bytes,
            "attention_kv_heads": self.attention_kv_heads,
            **({"attention_heads": self.attention_heads} if self.attention_heads else {}),
            **({"refused_splits": list(self.refused_splits)} if self.refused_splits else {}),
            **({} if self.output_shape is None else {"output_shape": list(self.output_shape)}),
            **{n: getattr(self, n) for n in ("base_type", "block", "opaque") if getattr(self, n)},
            **({n: getattr(self, n) for n in MOE_FIELDS} if self.is_moe else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "layers[?]") -> "LayerProfile":
        k = "ModelProfile"
        ints = {n: field(d, n, k, int, where=where, minimum=0) for n in (
            "params", "trainable_params", "param_bytes", "grad_bytes", "optimizer_bytes",
            "activation_bytes", "flops_fwd", "flops_bwd")}
        for n, default in (("trainable_param_bytes", ints["grad_bytes"]),
                           ("compute_weight_bytes", 0), ("activation_saved_bytes", 0),
                           ("input_bytes", 0), ("calls", 1), ("matmul_flops_fwd", 0),
                           ("matmul_flops_bwd", 0), ("memory_traffic_bytes_fwd", 0),
                           ("memory_traffic_bytes_bwd", 0), ("attention_core_flops_fwd", 0),
                           ("attention_core_saved_bytes", 0), ("attention_kv_bytes", 0),
                           ("attention_kv_heads", 0), ("attention_heads", 0),
                           *((n, 0) for n in MOE_FIELDS if n != "moe_capacity_factor")):
            ints[n] = field(d, n, k, int, where=where, minimum=0, optional=True,
                            default=default)
        ints["groups"] = field(d, "groups", k, int, where=where, minimum=1, optional=True,
                               default=1)
        ints["float_input_bytes"] = field(d, "float_input_bytes", k, int, where=where,
                                          minimum=-1, optional=True, default=-1)
        measured = {n: (None if d.get(n) is None else
                        field(d, n, k, float, where=where, minimum=0))
                    for n in ("measured_fwd_s", "measured_bwd_s")}
        return cls(
            name=field(d, "name", k, str, where=where), type=field(d, "type", k, str, where=where),
            **measured,
            inputs=_strings(field(d, "inputs", k, list, where=where, optional=True,
                                  default=[]), f"{k}.{where}.inputs"),
            not_counted=_strings(field(d, "not_counted", k, list, where=where, optional=True,
                                       default=[]), f"{k}.{where}.not_counted"),
            refused_splits=_strings(field(d, "refused_splits", k, list, where=where,
                                          optional=True, default=[]),
                                    f"{k}.{where}.refused_splits"),
            output_shape=_output_shape_from(d, where),
            **{n: field(d, n, k, str, where=where, optional=True, default="")
               for n in ("base_type", "block", "opaque")},
            moe_capacity_factor=field(d, "moe_capacity_factor", k, float, where=where,
                                      optional=True, default=0.0, minimum=0),
            **ints,
        )


# LayerProfile's mixture-of-experts fields, written only for MoE layers
MOE_FIELDS = ("moe_experts", "moe_top_k", "moe_expert_params", "moe_capacity_factor",
              "moe_tokens", "moe_dispatch_bytes", "moe_expert_flops_fwd",
              "moe_executed_flops_fwd")


def _output_shape_from(d: Mapping[str, Any], where: str) -> tuple[int | None, ...] | None:
    raw = d.get("output_shape")
    if raw is None:
        return None
    if not (isinstance(raw, list) and all(
            x is None or (isinstance(x, int) and not isinstance(x, bool)) for x in raw)):
        raise SchemaError(f"ModelProfile.{where}.output_shape is {raw!r}; expected a list of "
                          "dimensions (ints, null for a dynamic one) or null.")
    return tuple(raw)


@dataclass(frozen=True)
class Edge:
    """A tensor flowing from one layer to another, with its size for the profiled batch."""

    src: str
    dst: str
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"src": self.src, "dst": self.dst, "bytes": self.bytes}


@dataclass(frozen=True)
class ModelProfile:
    """A whole model's per-layer costs, in a topological order of its layer graph."""

    model_name: str
    batch_size: int
    precision: str  # dtype policy name: float32, mixed_float16, mixed_bfloat16
    optimizer: str  # e.g. "adam", "sgd"
    optimizer_slots_per_param: int
    layers: tuple[LayerProfile, ...]
    edges: tuple[Edge, ...] = ()
    warnings: tuple[str, ...] = ()
    # where and at which batch the layers' measured_*_s were taken ("" / 0: not measured)
    measured_device: str = ""
    measured_batch_size: int = 0
    measured_step_overhead_s: float = 0.0  # per step, outside the device kernels
    # (input name, per-sample dims) of each model input, as profiled: the model's own
    # shapes with its dynamic dimensions filled (``profiler.input_shapes``: --input-shape,
    # or the model file's sample_batch); () in profiles written before they were recorded
    input_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    schema_version: int = dc_field(default=SCHEMA_VERSION)

    # --- totals -----------------------------------------------------------------
    @property
    def params(self) -> int:
        return sum(l.params for l in self.layers)

    @property
    def trainable_params(self) -> int:
        return sum(l.trainable_params for l in self.layers)

    @property
    def param_bytes(self) -> int:
        return sum(l.param_bytes for l in self.layers)

    @property
    def state_bytes(self) -> int:
        return sum(l.state_bytes for l in self.layers)

    @property
    def flops_fwd(self) -> int:
        return sum(l.flops_fwd for l in self.layers)

    @property
    def flops_bwd(self) -> int:
        return sum(l.flops_bwd for l in self.layers)

    @property
    def activation_bytes(self) -> int:
        return sum(l.activation_bytes for l in self.layers)

    @property
    def activation_saved_bytes(self) -> int:
        return sum(l.activation_saved_bytes for l in self.layers)

    def totals(self) -> dict[str, int]:
        """The totals block of ``plan profile --json`` (sums over layers)."""
        def total(name: str) -> int:
            return sum(getattr(l, name) for l in self.layers)

        return {
            "params": self.params, "trainable_params": self.trainable_params,
            "non_trainable_params": self.params - self.trainable_params,
            "param_bytes": self.param_bytes,
            "trainable_param_bytes": total("trainable_param_bytes"),
            "compute_weight_bytes": total("compute_weight_bytes"),
            "grad_bytes": total("grad_bytes"), "optimizer_bytes": total("optimizer_bytes"),
            "activation_bytes": self.activation_bytes,
            "activation_saved_bytes": self.activation_saved_bytes,
            "input_bytes": total("input_bytes"),
            "flops_fwd": self.flops_fwd, "flops_bwd": self.flops_bwd,
        }

    @property
    def not_counted(self) -> tuple[str, ...]:
        return tuple(f"{l.name}: {what}" for l in self.layers for what in l.not_counted)

    @property
    def opaque_blocks(self) -> tuple[tuple[str, str], ...]:
        """(layer, why) for each layer the planner cannot see into (``LayerProfile.opaque``):
        it stays whole, replicated under tensor parallelism."""
        return tuple((l.name, l.opaque) for l in self.layers if l.opaque)

    @property
    def blocks(self) -> tuple[str, ...]:
        """The outermost blocks whose sub-layers have their own entries, in order."""
        return tuple(dict.fromkeys(l.block for l in self.layers if l.block))

    # --- identity ---------------------------------------------------------------
    def signature(self) -> tuple[tuple[str, str, int], ...]:
        """(name, type, params) per layer: what a plan checks a model against."""
        return tuple((l.name, l.type, l.params) for l in self.layers)

    def output_shapes(self) -> tuple[tuple[int | None, ...] | None, ...]:
        """Each layer's output shape per sample (None: unknown), in signature order; ()
        when no layer's is known (profiles written before shapes were recorded)."""
        shapes = tuple(l.output_shape for l in self.layers)
        return shapes if any(sh is not None for sh in shapes) else ()

    @property
    def fingerprint(self) -> str:
        return fingerprint_of(self.signature())

    def layer(self, name: str) -> LayerProfile:
        for l in self.layers:
            if l.name == name:
                return l
        raise KeyError(name)

    # --- JSON -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version, "model_name": self.model_name,
            "fingerprint": self.fingerprint, "batch_size": self.batch_size,
            "precision": self.precision, "optimizer": self.optimizer,
            "optimizer_slots_per_param": self.optimizer_slots_per_param,
            "totals": self.totals(), "layers": [l.to_dict() for l in self.layers],
            "edges": [e.to_dict() for e in self.edges], "warnings": list(self.warnings),
            "not_counted": list(self.not_counted),
            "opaque_blocks": [{"layer": n, "why": why} for n, why in self.opaque_blocks],
            "measured_device": self.measured_device,
            "measured_batch_size": self.measured_batch_size,
            "measured_step_overhead_s": self.measured_step_overhead_s,
            "input_shapes": {n: list(dims) for n, dims in self.input_shapes},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelProfile":
        k = "ModelProfile"
        check_version(d, k)
        layers = tuple(LayerProfile.from_dict(ld, where=f"layers[{i}]")
                       for i, ld in enumerate(field(d, "layers", k, list)))
        if not layers:
            raise SchemaError(f"{k}.layers is empty; a profile has at least one layer. "
                              "Regenerate the file (`plan profile --json` or `plan analyze`).")
        edges = tuple(Edge(src=field(e, "src", k, str, where=f"edges[{i}]"),
                           dst=field(e, "dst", k, str, where=f"edges[{i}]"),
                           bytes=field(e, "bytes", k, int, where=f"edges[{i}]", minimum=0))
                      for i, e in enumerate(field(d, "edges", k, list, optional=True, default=[])))
        return cls(
            model_name=field(d, "model_name", k, str),
            batch_size=field(d, "batch_size", k, int, minimum=1),
            precision=field(d, "precision", k, str),
            optimizer=field(d, "optimizer", k, str),
            optimizer_slots_per_param=field(d, "optimizer_slots_per_param", k, int, minimum=0),
            layers=layers, edges=edges,
            warnings=tuple(field(d, "warnings", k, list, optional=True, default=[])),
            measured_device=field(d, "measured_device", k, str, optional=True, default=""),
            measured_batch_size=field(d, "measured_batch_size", k, int, optional=True,
                                      default=0, minimum=0),
            measured_step_overhead_s=field(d, "measured_step_overhead_s", k, float,
                                           optional=True, default=0.0, minimum=0),
            input_shapes=input_shapes_from(
                field(d, "input_shapes", k, dict, optional=True, default={}),
                f"{k}.input_shapes"),
        )


def input_shapes_from(raw: Mapping[str, Any], path: str
                      ) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``{input name: [dims]}`` from a profile or plan file as ``(name, dims)`` pairs
    (``ModelProfile.input_shapes``, ``Plan.model_input_shapes``)."""
    out = []
    for name, dims in raw.items():
        if not (isinstance(dims, list) and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in dims)):
            raise SchemaError(f"{path}[{name!r}] is {dims!r:.80}; expected a list of "
                              "dimensions (whole numbers >= 1) after the batch one.")
        out.append((str(name), tuple(dims)))
    return tuple(out)


def fingerprint_of(signature: tuple[tuple[str, str, int], ...]) -> str:
    """A short stable hash of a model signature (layer names, types, parameter counts)."""
    text = "\n".join(f"{n}|{t}|{p}" for n, t, p in signature)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
