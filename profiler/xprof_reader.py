"""Reading a TensorFlow profiler capture back with XProf: op times per step.

Pipeline position: helper of ``profiler.measure``. ``measure_model`` captures
training steps with ``tf.profiler.experimental.start/stop`` into
``logdir/plugins/profile/<run>/<host>.xplane.pb``; this module turns that file
into plain numbers through XProf's own converters
(``xprof.convert.raw_to_tool_data.xspace_to_tool_data``), the code behind
TensorBoard's Profile tab. It knows nothing about Keras or layers.

Two XProf tools are read:

* ``trace_viewer``: every traced event with its start and duration. Used for
  the step markers (``tf.profiler.experimental.Trace(name, step_num=i, _r=1)``)
  and, on the host, for the TensorFlow op events (their ``long_name`` argument
  is ``"op/name:OpType"``). Host ops run on several executor threads at once,
  so summing their durations overcounts wall time; ``host_op_wall_times``
  splits each instant of a step among the ops running at that instant (k ops
  at once get 1/k of it each), so op times add up to the time some op was
  running, never more than the step.
* ``framework_op_stats``: XProf's per-op table. Its ``Device`` rows hold each
  op's self time on the accelerator (XProf maps GPU kernels to the ops that
  launched them), which ``device_op_self_times`` returns.

Both also give the type of the kernel that ran for each op name
(``host_op_types``, ``device_op_stats``): after Grappler's and oneDNN's graph
rewrites it can differ from the op's type in the graph (``_MklMatMul`` for
``MatMul``; ``_FusedConv2D`` for a Conv2D, BiasAdd and Relu run as one kernel
named after the Relu), which is how ``profiler.fused_kernels`` finds fusions.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

from tfplan.core.errors import PlannerError

_US = 1e-6  # trace_viewer timestamps and durations are microseconds


@dataclass(frozen=True)
class StepWindow:
    """One step marker from the trace: its number and [start, end) in seconds."""

    step_num: int
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class HostOpTimes:
    """Wall-clock time of host TensorFlow ops inside the step windows, summed over steps.

    ``op_time_s[name]``: the op's share of wall time (concurrent ops split each
    instant equally); ``busy_s``: time at least one op was running (equals the
    sum of ``op_time_s``); ``steps``: the windows used.
    """

    steps: tuple[StepWindow, ...]
    op_time_s: Mapping[str, float]
    busy_s: float


def xplane_files(logdir: str) -> list[str]:
    """The ``*.xplane.pb`` captures under ``logdir/plugins/profile/*/``, oldest first."""
    paths = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
    return sorted(paths, key=lambda p: (os.path.getmtime(p), p))


@contextlib.contextmanager
def _quiet_fd2() -> Iterator[list[str]]:
    """Capture file descriptor 2 (XProf's C++ logging) and hand back its lines."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines.extend(capture.read().decode(errors="replace").splitlines())


def tool_json(paths: Sequence[str], tool: str) -> Any:
    """Run XProf tool ``tool`` on the capture files and parse its JSON answer."""
    try:
        from xprof.convert import raw_to_tool_data
    except ImportError as e:
        raise PlannerError(
            f"Reading a profile needs XProf (pip package tensorboard-plugin-profile, module "
            f"xprof); importing it failed: {e}. Install it with "
            "`pip install tensorboard-plugin-profile`.") from e
    with _quiet_fd2() as log:
        try:
            # use_saved_result False: a capture that reuses a run folder (same second) must
            # not be answered from the cache XProf wrote there for the previous one
            data, _content_type = raw_to_tool_data.xspace_to_tool_data(
                list(paths), tool, {"use_saved_result": False})
        except Exception as e:  # the converter raises whatever its C++ side reports
            error: Exception | None = e
            data = None
        else:
            error = None
    if error is not None or not data:
        tail = "\n".join(line for line in log if line[:1] in ("E", "F"))[-2000:]
        raise PlannerError(
            f"XProf could not convert {', '.join(paths)} with tool {tool!r}"
            f"{f': {error}' if error else ' (empty answer)'}. Expected a capture written by "
            "tf.profiler.experimental.start/stop; check that the file is complete and that "
            "tensorboard-plugin-profile matches this TensorFlow."
            + (f"\nXProf said:\n{tail}" if tail else ""))
    try:
        return json.loads(data)
    except ValueError as e:
        raise PlannerError(f"XProf tool {tool!r} returned something that is not JSON "
                           f"({str(data)[:120]!r}...): {e}.") from e


# --- trace_viewer ------------------------------------------------------------------------
def trace_events(paths: Sequence[str]) -> list[Mapping[str, Any]]:
    """Complete events (``ph == "X"``) of XProf's trace_viewer, with ``process`` names added."""
    doc = tool_json(paths, "trace_viewer")
    events = doc.get("traceEvents", []) if isinstance(doc, Mapping) else []
    processes = {e.get("pid"): e.get("args", {}).get("name", "")
                 for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [dict(e, process=processes.get(e.get("pid"), "")) for e in events
            if e.get("ph") == "X" and "dur" in e and "ts" in e]


def step_windows(events: Sequence[Mapping[str, Any]], marker: str) -> tuple[StepWindow, ...]:
    """The step markers named ``marker`` (``Trace(marker, step_num=i, _r=1)``), in order."""
    steps = []
    for e in events:
        args = e.get("args", {})
        if "step_num" in args and str(e.get("name", "")).startswith(marker):
            start = float(e["ts"]) * _US
            steps.append(StepWindow(int(args["step_num"]), start,
                                    start + float(e["dur"]) * _US))
    return tuple(sorted(steps, key=lambda s: s.start_s))


def host_op_name(event: Mapping[str, Any]) -> str | None:
    """The TensorFlow op name of a host op event (``long_name`` ``"name:Type"``), else None."""
    long_name = event.get("args", {}).get("long_name")
    if not isinstance(long_name, str) or ":" not in long_name:
        return None
    return long_name.rsplit(":", 1)[0]


def host_op_types(events: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The kernel type of each host op event's op (``long_name`` ``"name:Type"``), by op name.

    The type is the one that ran, after graph rewrites: e.g. ``_MklNativeFusedMatMul``
    for a MatMul, BiasAdd and Relu fused into one kernel named after the Relu.
    """
    types = {}
    for e in events:
        if not str(e.get("process", "")).startswith("/host"):
            continue
        long_name = e.get("args", {}).get("long_name")
        if isinstance(long_name, str) and ":" in long_name:
            name, op_type = long_name.rsplit(":", 1)
            types[name] = op_type
    return types


def _self_intervals(events: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Per thread: an event's time minus the time of events nested inside it."""
    out: list[tuple[float, float, str]] = []
    stack: list[list[Any]] = []  # [start, end, name, cursor]

    def close_until(t: float) -> None:
        while stack and stack[-1][1] <= t:
            start, end, name, cursor = stack.pop()
            if end > cursor:
                out.append((cursor, end, name))
            if stack:
                stack[-1][3] = max(stack[-1][3], end)

    for start, end, name in sorted(events, key=lambda e: (e[0], -e[1])):
        close_until(start)
        if stack:  # nested: the parent's own time stops here
            parent = stack[-1]
            if start > parent[3]:
                out.append((parent[3], start, parent[2]))
            parent[3] = start
        stack.append([start, end, name, start])
    close_until(float("inf"))
    return out


def host_op_wall_times(events: Sequence[Mapping[str, Any]],
                       steps: Sequence[StepWindow]) -> HostOpTimes:
    """Split the wall time of each step among the host op events running in it.

    Nested op events on one thread count only their own (self) time; across
    threads, an instant where k ops run gives each 1/k of it. Time outside the
    step windows is ignored.
    """
    per_thread: dict[tuple[Any, Any], list[tuple[float, float, str]]] = defaultdict(list)
    for e in events:
        if not str(e.get("process", "")).startswith("/host"):
            continue
        name = host_op_name(e)
        if name is None or float(e["dur"]) <= 0:
            continue
        start = float(e["ts"]) * _US
        per_thread[(e.get("pid"), e.get("tid"))].append(
            (start, start + float(e["dur"]) * _US, name))
    intervals = [iv for evs in per_thread.values() for iv in _self_intervals(evs)]
    op_time: dict[str, float] = defaultdict(float)
    busy = 0.0
    for step in steps:
        # sweep line over the op intervals clipped to the step window
        points: list[tuple[float, int, str]] = []
        for start, end, name in intervals:
            s, t = max(start, step.start_s), min(end, step.end_s)
            if t > s:
                points.append((s, 1, name))
                points.append((t, -1, name))
        points.sort(key=lambda p: (p[0], p[1]))
        active: dict[str, int] = defaultdict(int)
        running = 0
        last = None
        for time_s, delta, name in points:
            if last is not None and running > 0 and time_s > last:
                share = (time_s - last) / running
                busy += time_s - last
                for op, count in active.items():
                    if count:
                        op_time[op] += share * count
            active[name] += delta
            running += delta
            last = time_s
    return HostOpTimes(steps=tuple(steps), op_time_s=dict(op_time), busy_s=busy)


# --- framework_op_stats ------------------------------------------------------------------
def device_op_self_times(paths: Sequence[str]) -> dict[str, float]:
    """Self time on the accelerator per op name (seconds, summed over the capture).

    From the ``Device`` rows of XProf's framework_op_stats (IDLE excluded);
    empty when the capture has no device activity (CPU only).
    """
    return device_op_stats(paths)[0]


def device_op_stats(paths: Sequence[str]) -> tuple[dict[str, float], dict[str, str]]:
    """``device_op_self_times`` and, per op name, the op type its row gives (the
    kernel's, after graph rewrites: e.g. ``_FusedConv2D``)."""
    doc = tool_json(paths, "framework_op_stats")
    tables = doc if isinstance(doc, list) else [doc]
    times: dict[str, float] = defaultdict(float)
    types: dict[str, str] = {}
    for table in tables[-1:]:  # the last table leaves IDLE out
        cols = [c.get("id") for c in table.get("cols", [])]
        for row in table.get("rows", []):
            values = dict(zip(cols, (c.get("v") for c in row.get("c", []))))
            if values.get("host_or_device") != "Device" or values.get("type") == "IDLE":
                continue
            name = str(values.get("operation")).rsplit(":", 1)[0]  # "name:Type" -> name
            times[name] += float(values.get("total_self_time") or 0) * _US
            if values.get("type"):
                types[name] = str(values["type"])
    return dict(times), types
