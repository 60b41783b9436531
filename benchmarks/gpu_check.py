"""GPU check: measured per-layer time and peak memory beside the planner's predictions.

Pipeline position: a benchmark outside the pipeline that checks two of its
stages against a real device. For examples/mlp.py, examples/cnn.py and a
GPT-2-small-sized model built from stock Keras layers (12 layers, hidden 768,
12 heads, sequence 1024, vocabulary 50257), it

* measures: a few real training steps on GPU:0, captured with TensorFlow's
  profiler and read back with XProf (``profiler.measure.measure_source``):
  forward and backward time per layer, step time, peak memory
  (``tf.config.experimental.get_memory_info('GPU:0')['peak']``);
* predicts: FLOPs and bytes from the static profile
  (``profiler.static.profile_source``, no weights allocated), turned into
  seconds by ``planner.cost_model.compute_time_s`` (FLOPs / (datasheet peak x
  matmul efficiency)) for the cluster preset closest to the GPU, and into
  bytes by ``planner.cost_model.layer_memory_bytes`` (weights + gradients +
  optimizer state + output activations, x MEMORY_MARGIN);

and prints them side by side. Expected to take a few minutes on one GPU, most
of it building and tracing the GPT (not yet run on one: this host has none; on
this 2-core CPU, ``--cpu`` takes about 20 s). Without a GPU it says so and
exits with status 2;
``--cpu`` runs the same table on this host's CPU at small sizes (the GPT shrinks
to 2 layers, hidden 128), priced against ``cpu:1``'s nominal figures.

    python benchmarks/gpu_check.py [--cpu] [--steps 5] [--out out/gpu_check]
                                   [--cluster PRESET] [--models mlp,cnn,gpt] [--json]

Each capture stays under ``OUT/<model>/plugins/profile/``: ``tensorboard
--logdir OUT`` opens it in the Profile tab.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tfplan.core.errors import PlannerError  # noqa: E402

MiB = 2**20


@dataclass(frozen=True)
class GptSize:
    num_layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int


GPT2_SMALL = GptSize(num_layers=12, hidden=768, heads=12, seq=1024, vocab=50257)
GPT_CPU = GptSize(num_layers=2, hidden=128, heads=4, seq=128, vocab=1024)
# batch sizes: large enough that a step is mostly device work, small enough to be quick
GPU_BATCH = {"mlp": 65536, "cnn": 1024, "gpt": 8}
CPU_BATCH = {"mlp": 16384, "cnn": 128, "gpt": 4}
GROUP_ROWS_ABOVE = 24  # models with more layers are shown one row per layer type


# --- the GPT --------------------------------------------------------------------------------
def build_gpt(size: GptSize) -> Any:
    """A GPT-2-style decoder from stock Keras layers (pre-norm, GELU MLP, untied head)."""
    import keras

    tokens = keras.Input((size.seq,), dtype="int32", name="tokens")
    positions = keras.Input((size.seq,), dtype="int32", name="positions")
    x = keras.layers.Add(name="embed")([
        keras.layers.Embedding(size.vocab, size.hidden, name="wte")(tokens),
        keras.layers.Embedding(size.seq, size.hidden, name="wpe")(positions)])
    for i in range(size.num_layers):
        h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"h{i}_ln_1")(x)
        h = keras.layers.MultiHeadAttention(size.heads, size.hidden // size.heads,
                                            name=f"h{i}_attn")(h, h, use_causal_mask=True)
        x = keras.layers.Add(name=f"h{i}_add_1")([x, h])
        h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"h{i}_ln_2")(x)
        h = keras.layers.Dense(4 * size.hidden, activation="gelu", name=f"h{i}_mlp_fc")(h)
        h = keras.layers.Dense(size.hidden, name=f"h{i}_mlp_proj")(h)
        x = keras.layers.Add(name=f"h{i}_add_2")([x, h])
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_f")(x)
    logits = keras.layers.Dense(size.vocab, use_bias=False, name="lm_head")(x)
    return keras.Model([tokens, positions], logits, name="gpt")


def gpt_source(size: GptSize) -> Any:
    import keras
    import numpy as np

    from tfplan.profiler.loader import ModelSource

    def sample_batch(batch_size: int) -> tuple[list[Any], Any]:
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, size.vocab, (batch_size, size.seq), dtype=np.int32)
        positions = np.tile(np.arange(size.seq, dtype=np.int32), (batch_size, 1))
        return [tokens, positions], np.roll(tokens, -1, axis=1)

    name = (f"gpt ({size.num_layers} layers, hidden {size.hidden}, {size.heads} heads, "
            f"seq {size.seq}, vocab {size.vocab})")
    return ModelSource(name=name, build_model=lambda: build_gpt(size),
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                       optimizer="adam", sample_batch=sample_batch,
                       origin="benchmarks/gpu_check.py:build_gpt")


# --- predictions ---------------------------------------------------------------------------
def predictions(profile: Any, device: Any) -> dict[str, Any]:
    """Per-layer predicted seconds and the model's predicted memory for ``profile``'s batch."""
    from tfplan.planner.cost_model import compute_time_s, layer_memory_bytes, optimizer_time_s

    layers = OrderedDict()
    for l in profile.layers:
        layers[l.name] = {
            "flops_fwd": l.flops_fwd, "flops_bwd": l.flops_bwd,
            "time_fwd_s": compute_time_s(l.flops_fwd, device, profile.precision),
            "time_bwd_s": compute_time_s(l.flops_bwd, device, profile.precision),
            "not_counted": list(l.not_counted)}
    totals = profile.totals()
    return {
        "layers": layers,
        "optimizer_time_s": optimizer_time_s(totals["param_bytes"], totals["grad_bytes"],
                                             totals["optimizer_bytes"], device),
        "memory_bytes": sum(layer_memory_bytes(l, profile.batch_size, profile.batch_size)
                            for l in profile.layers),
        "achieved_flops_per_s": device.achieved_flops(profile.precision),
    }


# --- table ---------------------------------------------------------------------------------
def _ms(seconds: float | None) -> str:
    return "n/c" if seconds is None else f"{seconds * 1e3:.3f}"


def _rows(measured: Any, predicted: dict[str, Any]) -> list[tuple[str, str, Any, Any]]:
    """(label, type, measured fwd/bwd, predicted entry) per layer, or per type for big models."""
    pred = predicted["layers"]
    rows = [(l.name, l.type, (l.time_fwd_s, l.time_bwd_s), pred.get(l.name))
            for l in measured.layers]
    if len(rows) <= GROUP_ROWS_ABOVE:
        return rows
    groups: OrderedDict[str, list[Any]] = OrderedDict()
    for name, typ, (f, b), p in rows:
        g = groups.setdefault(typ, [0, 0.0, 0.0, {"flops_fwd": 0, "flops_bwd": 0,
                                                  "time_fwd_s": 0.0, "time_bwd_s": 0.0,
                                                  "not_counted": []}])
        g[0] += 1
        g[1] += f
        g[2] += b
        if p is not None:
            for key in ("flops_fwd", "flops_bwd", "time_fwd_s", "time_bwd_s"):
                g[3][key] += p[key]
            g[3]["not_counted"] += p["not_counted"]
    return [(f"{n} x {typ}", typ, (f, b), p) for typ, (n, f, b, p) in groups.items()]


def render(case: str, measured: Any, predicted: dict[str, Any], cluster: str) -> str:
    out = [f"== {case}: batch {measured.batch_size}, measured on {measured.device}, "
           f"predicted for {cluster} "
           f"({predicted['achieved_flops_per_s'] / 1e12:.3g} TFLOP/s achieved) =="]
    head = (f"{'layer':<26}{'GFLOP fwd':>11}{'GFLOP bwd':>11}{'pred fwd':>10}{'meas fwd':>10}"
            f"{'pred bwd':>10}{'meas bwd':>10}{'meas/pred':>10}")
    out += [head + "   (times in ms per step)", "-" * len(head)]
    for label, _typ, (f, b), p in _rows(measured, predicted):
        counted = p is not None and not p["not_counted"]
        pf = p["time_fwd_s"] if counted else None
        pb = p["time_bwd_s"] if counted else None
        # no ratio where the prediction is under a microsecond: it would be all noise
        ratio = f"{(f + b) / (pf + pb):.1f}" if counted and pf + pb >= 1e-6 else "-"
        gf = f"{p['flops_fwd'] / 1e9:.4g}" if p else "-"
        gb = f"{p['flops_bwd'] / 1e9:.4g}" if p else "-"
        out.append(f"{label[:25]:<26}{gf:>11}{gb:>11}{_ms(pf):>10}{_ms(f):>10}{_ms(pb):>10}"
                   f"{_ms(b):>10}{ratio:>10}")
    pred_layers = sum(p["time_fwd_s"] + p["time_bwd_s"] for p in predicted["layers"].values())
    out += [
        "-" * len(head),
        f"layers: measured {_ms(measured.layer_time_s)} ms, predicted compute "
        f"{_ms(pred_layers)} ms (n/c layers count 0)",
        f"outside layers (loss, optimizer, gradient sums): measured "
        f"{_ms(measured.unattributed_time_s)} ms; predicted optimizer update "
        f"{_ms(predicted['optimizer_time_s'])} ms",
        f"idle (dispatch, scheduling, sync): {_ms(measured.idle_time_s)} ms",
        f"step: measured {_ms(measured.step_time_s)} ms in the trace "
        f"({_ms(measured.step_time_unprofiled_s)} ms without the profiler); layers are "
        f"{measured.attributed_fraction:.0%} of it, all ops {measured.op_fraction:.0%}",
        f"peak memory: measured {measured.peak_memory_bytes / MiB:.1f} MiB; predicted "
        f"{predicted['memory_bytes'] / MiB:.1f} MiB (weights + gradients + optimizer state + "
        "output activations, x1.10 margin)",
        f"  measured as: {measured.peak_memory_source}",
        f"capture: {measured.trace_files[0]}",
    ]
    out += [f"warning: {w}" for w in measured.warnings]
    return "\n".join(out)


# --- main ---------------------------------------------------------------------------------
def auto_cluster(device_name: str) -> str:
    """The preset closest to the GPU TensorFlow reports (H200 priced as H100: same SXM math)."""
    name = device_name.upper()
    if "A100" in name:
        return "8xA100-80GB" if "80" in name else "8xA100-40GB"
    if "V100" in name:
        return "8xV100-32GB"
    return "8xH100-80GB"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Measure per-layer time and peak memory on a GPU "
                                            "and print them beside the planner's predictions.")
    p.add_argument("--cpu", action="store_true",
                   help="run on this host's CPU at small sizes (priced against cpu:1)")
    p.add_argument("--steps", type=int, default=5, help="profiled steps per model (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps (default 2)")
    p.add_argument("--out", default=os.path.join("out", "gpu_check"),
                   help="logdir root for the captures (default out/gpu_check)")
    p.add_argument("--cluster", default=None,
                   help="preset to price predictions with (default: closest to the GPU; "
                        "cpu:1 with --cpu)")
    p.add_argument("--models", default="mlp,cnn,gpt", help="comma list of mlp, cnn, gpt")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - {"mlp", "cnn", "gpt"})
    if unknown:
        print(f"gpu_check: unknown model(s) {', '.join(unknown)}; expected mlp, cnn, gpt.",
              file=sys.stderr)
        return 2
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU run stays on the CPU
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # so get_memory_info('CPU:0') counts
    from tfplan.profiler.tf_runtime import import_tensorflow

    tf = import_tensorflow()
    gpus = tf.config.list_physical_devices("GPU")
    if not args.cpu and not gpus:
        print("gpu_check: no GPU is visible to TensorFlow (tf.config.list_physical_devices"
              "('GPU') is empty), so there is nothing to check. Run it on a machine with a "
              "GPU and a CUDA build of TensorFlow, or pass --cpu to run the same table on "
              "this CPU at small sizes.", file=sys.stderr)
        return 2
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)

    from tfplan.core.presets import parse_cluster
    from tfplan.profiler.loader import load_model_source
    from tfplan.profiler.measure import measure_source
    from tfplan.profiler.static import profile_source

    if args.cpu:
        cluster_name = args.cluster or "cpu:1"
    else:
        details = tf.config.experimental.get_device_details(gpus[0])
        cluster_name = args.cluster or auto_cluster(details.get("device_name", ""))
    try:
        device = parse_cluster(cluster_name).device
    except PlannerError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    batches = CPU_BATCH if args.cpu else GPU_BATCH
    sources: dict[str, Callable[[], Any]] = {
        "mlp": lambda: load_model_source(os.path.join(ROOT, "examples", "mlp.py")),
        "cnn": lambda: load_model_source(os.path.join(ROOT, "examples", "cnn.py")),
        "gpt": lambda: gpt_source(GPT_CPU if args.cpu else GPT2_SMALL),
    }
    results, failed, started = [], 0, time.perf_counter()
    for key in models:
        t0 = time.perf_counter()
        try:
            source = sources[key]()
            profile = profile_source(source, batches[key])
            predicted = predictions(profile, device)
            measured = measure_source(source, batches[key], steps=args.steps,
                                      warmup_steps=args.warmup,
                                      logdir=os.path.join(args.out, key))
        except PlannerError as e:
            failed += 1
            print(f"gpu_check: {key}: {e}", file=sys.stderr)
            continue
        results.append({"case": key, "model": source.name, "cluster": cluster_name,
                        "seconds": time.perf_counter() - t0, "measured": measured.to_dict(),
                        "predicted": predicted})
        if not args.json:
            print(render(source.name, measured, predicted, cluster_name))
            print(f"({time.perf_counter() - t0:.1f} s)\n", flush=True)
    if args.json:
        print(json.dumps({"cases": results, "seconds": time.perf_counter() - started}))
    else:
        print(f"total {time.perf_counter() - started:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
