"""The measured profile's value: ``LayerTime`` and ``MeasuredProfile``.

Pipeline position: ``profiler.measure`` fills a MeasuredProfile from a few real
training steps; the CLI, reports and ``benchmarks/gpu_check.py`` read it. Like
``profiler.model_profile`` this module imports no TensorFlow, so a saved
measurement loads on any machine. Seconds are per training step, averaged over
the profiled steps; bytes are bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field as dc_field
from typing import Any, Mapping

from tfplan.core.schema import SCHEMA_VERSION, check_version, field


@dataclass(frozen=True)
class LayerTime:
    """One layer's measured time per training step (seconds, averaged over the steps)."""

    name: str
    type: str
    time_fwd_s: float
    time_bwd_s: float
    scopes: tuple[str, ...] = ()  # the TensorFlow name scopes its calls ran in
    #: layers whose ops ran in one fused kernel with this layer's (its time split among
    #: them: ``profiler.fused_kernels``); empty when none
    fused_with: tuple[str, ...] = ()

    @property
    def time_s(self) -> float:
        return self.time_fwd_s + self.time_bwd_s

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "time_fwd_s": self.time_fwd_s,
                "time_bwd_s": self.time_bwd_s, "scopes": list(self.scopes),
                "fused_with": list(self.fused_with)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "layers[?]") -> "LayerTime":
        k = "MeasuredProfile"
        return cls(name=field(d, "name", k, str, where=where),
                   type=field(d, "type", k, str, where=where),
                   time_fwd_s=field(d, "time_fwd_s", k, float, where=where, minimum=0),
                   time_bwd_s=field(d, "time_bwd_s", k, float, where=where, minimum=0),
                   scopes=tuple(field(d, "scopes", k, list, where=where, optional=True,
                                      default=[])),
                   fused_with=tuple(field(d, "fused_with", k, list, where=where,
                                          optional=True, default=[])))


@dataclass(frozen=True)
class MeasuredProfile:
    """Measured per-layer times and peak memory of a few real training steps.

    Per step: ``step_time_s = layer_time_s + unattributed_time_s + idle_time_s``.
    ``unattributed`` breaks ``unattributed_time_s`` down by the ops' first name
    scope (e.g. ``adam``, ``sparse_categorical_crossentropy``), largest first.
    """

    model_name: str
    batch_size: int
    steps: int
    warmup_steps: int
    device: str  # e.g. "CPU:0", "GPU:0 (NVIDIA H100 80GB HBM3)"
    time_source: str  # which XProf numbers the op times come from
    step_time_s: float
    step_time_unprofiled_s: float
    layers: tuple[LayerTime, ...]
    unattributed_time_s: float
    idle_time_s: float
    peak_memory_bytes: int
    peak_memory_source: str
    logdir: str
    trace_files: tuple[str, ...]
    unattributed: tuple[tuple[str, float], ...] = ()
    warnings: tuple[str, ...] = ()
    schema_version: int = dc_field(default=SCHEMA_VERSION)

    @property
    def layer_time_s(self) -> float:
        """Sum over layers of forward + backward seconds per step."""
        return sum(l.time_s for l in self.layers)

    @property
    def attributed_fraction(self) -> float:
        """layer_time_s / step_time_s: the share of the step the layers account for."""
        return self.layer_time_s / self.step_time_s

    @property
    def op_fraction(self) -> float:
        """(layer_time_s + unattributed_time_s) / step_time_s: the share some op ran."""
        return (self.layer_time_s + self.unattributed_time_s) / self.step_time_s

    def layer(self, name: str) -> LayerTime:
        for l in self.layers:
            if l.name == name:
                return l
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version, "model_name": self.model_name,
            "batch_size": self.batch_size, "steps": self.steps,
            "warmup_steps": self.warmup_steps, "device": self.device,
            "time_source": self.time_source, "step_time_s": self.step_time_s,
            "step_time_unprofiled_s": self.step_time_unprofiled_s,
            "layer_time_s": self.layer_time_s,
            "unattributed_time_s": self.unattributed_time_s, "idle_time_s": self.idle_time_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "peak_memory_source": self.peak_memory_source, "logdir": self.logdir,
            "trace_files": list(self.trace_files),
            "layers": [l.to_dict() for l in self.layers],
            "unattributed": [{"scope": s, "time_s": t} for s, t in self.unattributed],
            "warnings": list(self.warnings),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MeasuredProfile":
        k = "MeasuredProfile"
        check_version(d, k)
        return cls(
            model_name=field(d, "model_name", k, str),
            batch_size=field(d, "batch_size", k, int, minimum=1),
            steps=field(d, "steps", k, int, minimum=1),
            warmup_steps=field(d, "warmup_steps", k, int, minimum=0),
            device=field(d, "device", k, str), time_source=field(d, "time_source", k, str),
            step_time_s=field(d, "step_time_s", k, float, minimum=0),
            step_time_unprofiled_s=field(d, "step_time_unprofiled_s", k, float, minimum=0),
            layers=tuple(LayerTime.from_dict(l, where=f"layers[{i}]")
                         for i, l in enumerate(field(d, "layers", k, list))),
            unattributed_time_s=field(d, "unattributed_time_s", k, float, minimum=0),
            idle_time_s=field(d, "idle_time_s", k, float, minimum=0),
            peak_memory_bytes=field(d, "peak_memory_bytes", k, int, minimum=0),
            peak_memory_source=field(d, "peak_memory_source", k, str),
            logdir=field(d, "logdir", k, str),
            trace_files=tuple(field(d, "trace_files", k, list)),
            unattributed=tuple(
                (field(u, "scope", k, str, where=f"unattributed[{i}]"),
                 field(u, "time_s", k, float, where=f"unattributed[{i}]", minimum=0))
                for i, u in enumerate(field(d, "unattributed", k, list, optional=True,
                                            default=[]))),
            warnings=tuple(field(d, "warnings", k, list, optional=True, default=[])),
        )
