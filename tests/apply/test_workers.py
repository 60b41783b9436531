"""One program per worker (``apply.spmd`` across worker processes).

``plan launch --workers W`` starts this file as a script on W workers (TF_CONFIG on
127.0.0.1, C logical CPUs each: the shape of W GPU hosts of C GPUs); each worker wraps the
tiny models with hand-made plans over ``/job:worker/task:w/device:CPU:i`` and trains them,
running its own devices' columns only (``RunDescription.local``), its collectives meeting
the other workers' in the plan's groups; the test process trains the same models on one
device. Losses of 10 ``train_on_batch`` steps must agree within 1e-4 (relative) on every
worker, every variable and optimizer slot of a worker must sit on one of its own planned
devices, and where a case says so the worker's communication audit (``apply.audit``) must be
within 10% of the plan's bytes for each of its devices (``planner.traffic``).

Three launches by default: 2 workers of 4 CPUs (``CASES``: data parallel across the workers
with tensor parallelism and pipelines inside, ZeRO-3 over all 8 devices, expert and context
parallel groups across the workers, global BatchNormalization statistics and clipping over
every replica; the first case of each launch also runs fit/evaluate/predict and a weight
file round trip; ``DATASETS`` fit, evaluate and predict on ``tf.data.Dataset``s, each worker
reading only its columns' rows of a dataset's batches), 4 workers of 2 CPUs (``FOUR_CASES``: tensor ranks across workers, ZeRO-3
with a weight file gathered from every worker's shards) and 2 workers of 2 CPUs
(``PIPE_CASES``: pipeline stages across the workers, GPipe, 1F1B, interleaved, with tp inside
and with dp, ZeRO-1/2/3 (with ``global_clipnorm`` over the column's workers), and a general
placement across them), each stage's weights on its own worker only.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

if __name__ == "__main__":  # a worker: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))

from tests.apply.helpers import (HERE, base_model, batches_of, fresh_optimizer,  # noqa: E402
                                 make_plan, rows, single_device_copy, step_losses)

ROOT = os.path.dirname(os.path.dirname(HERE))
WORKERS, CPUS = 2, 2  # the shape the apply.remote and backup tests launch (2xcpu:2)
STEPS = 10
GLOBAL_BATCH = 16
SPLITS = {
    "tiny_mlp": (("dense_in", "column"), ("hidden", "row"), ("narrow", "column"),
                 ("head", "row")),
    "tiny_transformer": (("embed", "vocab"), ("attention", "heads"), ("mlp_up", "column"),
                         ("mlp_down", "row"), ("logits", "column")),
    "tiny_cnn": (("stem", "row"), ("res_a", "column"), ("res_b", "row"),
                 ("classifier", "column")),
    # keras_hub's Llama 3 backbone (tests/apply/tiny_hub.py): each block's attention by
    # heads, its feed-forward Megatron's column/row pair
    "tiny_hub": tuple((f"llama/transformer_layer_{i}/{sub}", split) for i in range(2)
                      for sub, split in (("self_attention", "heads"),
                                         ("feedforward_gate_dense", "column"),
                                         ("feedforward_intermediate_dense", "column"),
                                         ("feedforward_output_dense", "row"))),
}
SCHEDULE = {"tiny_mlp": "gpipe", "tiny_transformer": "1f1b", "tiny_cnn": "1f1b",
            "tiny_resnet_bn": "gpipe", "tiny_hub": "1f1b", "tiny_seq2seq": "1f1b",
            "tiny_regularized": "1f1b"}
# (model, plan kind) on 2 workers of 4 CPUs; the first also runs fit/evaluate/predict/files
CASES = [("tiny_mlp", "dp2xpp2xtp2"), ("tiny_transformer", "dp2xtp4"),
         ("tiny_transformer", "dp8+zero3"), ("tiny_cnn", "dp4xtp2"),
         ("tiny_moe", "dp8xep2"), ("tiny_transformer", "dp4xcp2"),
         ("tiny_resnet_bn", "dp8"), ("tiny_mlp", "dp8+clip"), ("tiny_hub", "dp4xtp2")]
FOUR_CASES = [("tiny_transformer", "dp2xtp4"), ("tiny_mlp", "dp8+zero3")]  # 4 workers of 2
# a replica's pipeline stages (or a general placement's devices) on both of 2 workers of 2
# CPUs: its activations and their gradients cross by two-member collectives
PIPE_CASES = [("tiny_mlp", "pp2"), ("tiny_transformer", "pp2"), ("tiny_transformer", "pp2xtp2"),
              ("tiny_cnn", "dp2xpp2-across"), ("tiny_mlp", "pp2-interleaved"),
              ("branchy", "placement"), ("tiny_hub", "pp2"),
              ("tiny_mlp", "dp2xpp2-across+zero1+clip"),
              ("tiny_transformer", "dp2xpp2-across+zero2"),
              ("tiny_mlp", "dp2xpp2-across+zero3"), ("tiny_seq2seq", "pp2"),
              ("tiny_regularized", "pp2")]
# also running fit/evaluate/predict and a weight file round trip (each launch's first case
# does): the file's weights and optimizer state gathered from every worker's pieces
FULL = {"tiny_mlp dp8+zero3", "tiny_mlp dp2xpp2-across+zero3"}
AUDITED = {"tiny_transformer pp2xtp2", "tiny_transformer dp2xtp4", "tiny_transformer dp8+zero3", "tiny_moe dp8xep2",
           "tiny_transformer dp4xcp2", "tiny_transformer dp2xpp2-across+zero2"}
# also running fit (with validation data), evaluate and predict on tf.data.Datasets: each
# worker reads only its columns' rows (two replicas of two tensor ranks on each of two
# workers, padded; two replicas on each of four workers; each worker one sequence chunk
# of every row, predict joining the chunks across the workers), or, a column on both
# workers, every row
DATASETS = {"tiny_cnn dp4xtp2", "tiny_mlp dp8+zero3", "tiny_mlp pp2", "tiny_transformer dp4xcp2"}
# the last layer of stage 0 where the even split would cut a block: the seq2seq's masked
# embeddings cross to worker 1 with their Keras mask
FIRST_STAGE = {"tiny_seq2seq": "embed"}
CLIP_NORM = 0.5  # "+clip": SGD with global_clipnorm, below the MLP's gradient norms (~3)


def optimizer_for(module, kind: str):
    """The case's optimizer: the model file's, or (``+clip``) SGD that clips every step
    (Adam would hide a wrong clip: its steps ignore gradient scale)."""
    import keras

    if kind.endswith("+clip"):
        return keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=CLIP_NORM)
    return fresh_optimizer(module)


def dev(task: int, cpu: int) -> str:
    return f"/job:worker/task:{task}/device:CPU:{cpu}"


def cluster_plan(plan, workers: int, cpus: int, name: str):
    """``plan`` for a ``{workers}xcpu:{cpus}`` cluster."""
    one = plan.cluster
    cluster = dataclasses.replace(one, name=f"{workers}xcpu:{cpus}", num_nodes=workers,
                                  devices_per_node=cpus, inter_node_link=one.intra_node_link)
    return dataclasses.replace(plan, cluster=cluster, name=name)


def worker_plan(model, name: str, kind: str, workers: int = WORKERS, cpus: int = CPUS):
    """A plan for ``{workers}xcpu:{cpus}``: device i of a stage is ``dev(i // cpus, i % cpus)``
    (replica q's tensor rank t at i = q tp + t: tensor ranks inside a worker where tp
    divides its CPUs), except where the kind interleaves the workers (``ep``, ``cp``: the
    groups across them)."""
    every = [dev(i // cpus, i % cpus) for i in range(workers * cpus)]
    kind = kind.removesuffix("+clip")  # the optimizer's (optimizer_for)
    zero = re.search(r"\+zero(\d)", kind)  # "+zeroN": ZeRO-N
    s = {}
    splits = ()
    if kind == "dp2xpp2":  # (2 x 2: the apply.remote and backup tests) stage s on CPU s
        stages = [[dev(w, st) for w in range(workers)] for st in range(2)]
        plan = make_plan(model, stages, num_microbatches=2, global_batch=GLOBAL_BATCH)
        s = dict(layout="tp-pp-dp", schedule=SCHEDULE[name])
    elif kind == "dp2xpp2xtp2":  # worker w: replica w, stage s on its CPUs 2s, 2s + 1
        stages = [[dev(w, 2 * st + t) for w in range(workers) for t in range(2)]
                  for st in range(2)]
        plan = make_plan(model, stages, num_microbatches=2, global_batch=GLOBAL_BATCH)
        s = dict(layout="tp-pp-dp", schedule="1f1b", dp=2, tp=2)
        splits = SPLITS[name]
    elif kind in ("dp2xtp4", "dp4xtp2", "dp2xtp2"):
        tp = int(kind[-1])
        plan = make_plan(model, [every], global_batch=GLOBAL_BATCH)
        s = dict(dp=len(every) // tp, tp=tp)
        splits = SPLITS[name]
    elif kind == "dp8xep2":  # replica r on worker r % 2: each ep pair spans the workers
        devices = [dev(r % workers, r // workers) for r in range(workers * cpus)]
        plan = make_plan(model, [devices], global_batch=GLOBAL_BATCH)
        s = dict(ep=2)
    elif kind == "dp4xcp2":  # replica q = r cp + c on worker c: each cp pair spans them
        devices = [dev(q % workers, q // workers) for q in range(workers * cpus)]
        plan = make_plan(model, [devices], global_batch=GLOBAL_BATCH)
        s = dict(dp=len(devices) // 2, cp=2)
    elif kind in ("pp2", "pp2-interleaved"):  # stage s on worker s (the Megatron layout)
        virtual = 2 if kind.endswith("interleaved") else 1
        stages = [[dev(st % workers, 0)] for st in range(2 * virtual)]
        layers = None
        if name in FIRST_STAGE:  # stage 0 ends at that layer (a block stays whole)
            from tfplan.profiler.signature import model_signature

            entries = [row[0] for row in model_signature(model)]
            cut = max(i for i, e in enumerate(entries)
                      if e.split("/")[0] == FIRST_STAGE[name]) + 1
            layers = [entries[:cut], entries[cut:]]
        plan = make_plan(model, stages, num_microbatches=2, global_batch=GLOBAL_BATCH,
                         stage_layers=layers)
        s = dict(schedule="interleaved" if virtual > 1 else SCHEDULE[name],
                 virtual_stages=virtual, pp=2)
    elif kind == "pp2xtp2":  # stage s on worker s, tensor parallel over its CPUs
        stages = [[dev(st, t) for t in range(2)] for st in range(2)]
        plan = make_plan(model, stages, num_microbatches=2, global_batch=GLOBAL_BATCH)
        s = dict(schedule="1f1b", dp=1, tp=2)
        splits = SPLITS[name]
    elif kind.startswith("dp2xpp2-across"):  # stage s on worker s, replica r on its CPU r
        stages = [[dev(st, r) for r in range(2)] for st in range(2)]
        plan = make_plan(model, stages, num_microbatches=2, global_batch=GLOBAL_BATCH)
        # "+zeroN": each chunk's weights sharded over its worker's replicas
        s = dict(schedule="1f1b", zero_stage=int(zero.group(1)) if zero else 0)
    elif kind == "placement":  # a general placement, one branch per worker
        branchy = {dev(0, 0): ("stem", "branch_1", "head"), dev(1, 1): ("branch_0", "merge")}
        plan = make_plan(model, [[d] for d in branchy], global_batch=GLOBAL_BATCH,
                         stage_layers=list(branchy.values()))
        plan = dataclasses.replace(plan, placement="general")
    elif kind == "dp2":  # one device per worker
        plan = make_plan(model, [[dev(w, 0) for w in range(workers)]], global_batch=GLOBAL_BATCH)
    else:  # dp (every device), "+zeroN": ZeRO-N over all of them, "+clip"
        plan = make_plan(model, [every], global_batch=GLOBAL_BATCH)
        s = dict(zero_stage=int(zero.group(1))) if zero else {}
    dp = s.get("dp", plan.strategy.dp)
    s.setdefault("microbatch_size", GLOBAL_BATCH // (dp * plan.strategy.num_microbatches))
    plan = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy, **s),
                               tp_splits=splits)
    return cluster_plan(plan, workers, cpus, f"{name} {kind} over {workers} workers")


def scenario(model, module, weights_path: str | None, datasets: bool = False) -> dict:
    """What the wrapped model (on each worker) and the reference (one device) run."""
    import numpy as np

    result = {"losses": step_losses(model, batches_of(module, STEPS, GLOBAL_BATCH))}
    if datasets:
        result.update(_datasets(model, module))
    if module.__name__.endswith("_bn"):
        # inference uses the moving statistics: this worker's copy equals one device's
        xi, _ = module.sample_batch(8)
        result["inference"] = np.asarray(model(xi, training=False)).tolist()
    if weights_path is None:
        return result
    x, y = module.sample_batch(3 * GLOBAL_BATCH)
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0,
                        validation_data=module.sample_batch(21))
    result["fit_losses"] = [float(v) for v in history.history["loss"]]
    result["val_losses"] = [float(v) for v in history.history["val_loss"]]
    xe, ye = module.sample_batch(21)
    result["eval_loss"] = float(model.evaluate(xe, ye, batch_size=8, verbose=0))
    result["predictions"] = np.asarray(model.predict(rows(xe, 0, 7), batch_size=4,
                                                     verbose=0)).tolist()
    model.save_weights(weights_path)
    model.set_weights([np.zeros_like(w) for w in model.get_weights()])
    model.load_weights(weights_path)
    result["reloaded_eval_loss"] = float(model.evaluate(xe, ye, batch_size=8, verbose=0))
    return result


def _datasets(model, module) -> dict:
    """fit (with validation), evaluate and predict on ``tf.data.Dataset``s whose last batch
    is smaller: one program per worker, each worker reads only its columns' rows of each
    batch (``apply.spmd.input.worker_rows``)."""
    import numpy as np
    import tensorflow as tf

    def batched(*arrays, size=GLOBAL_BATCH):
        return tf.data.Dataset.from_tensor_slices(arrays).batch(size)

    # last batches of 8 rows: they split into the older engines' micro-batches too
    x, y = module.sample_batch(2 * GLOBAL_BATCH + 8)
    xv, yv = module.sample_batch(GLOBAL_BATCH + 8)
    history = model.fit(batched(x, y), epochs=2, verbose=0, validation_data=batched(xv, yv))
    xe, _ = module.sample_batch(GLOBAL_BATCH + 3)
    return {"dataset_fit_losses": [float(v) for v in history.history["loss"]],
            "dataset_val_losses": [float(v) for v in history.history["val_loss"]],
            "dataset_eval_loss": float(model.evaluate(batched(xv, yv), verbose=0)),
            "dataset_predictions": np.asarray(model.predict(batched(xe), verbose=0)).tolist()}


def _audit(wrapped, module, plan, task: int) -> dict:
    """This worker's devices: (measured, priced) bytes of one step (``apply.audit``
    against ``planner.traffic.plan_sent_bytes``)."""
    import keras

    from tfplan.apply.audit import audit_step
    from tfplan.planner.traffic import plan_sent_bytes
    from tfplan.profiler import profile_model

    x, y = module.sample_batch(GLOBAL_BATCH)
    audit = audit_step(wrapped, x, y, plan=plan)
    measured = {d: sum(v for k, v in kinds.items() if k not in ("input", "host"))
                for d, kinds in audit.by_device().items()}
    keras.utils.set_random_seed(0)
    priced = {d: sum(v for _, v in kinds) for d, kinds in
              plan_sent_bytes(profile_model(module.build_model(),
                                            batch_size=GLOBAL_BATCH), plan)}
    mine = [d for d in plan.devices if f"/task:{task}/" in d]
    return {d: [measured.get(d, 0), priced.get(d, 0)] for d in mine}


def weights_file(out_dir, cases: list, name: str, kind: str, prefix: str = "model"
                 ) -> str | None:
    """Where a case writes its weight file (the first case and ``FULL``'s; None: none)."""
    if (name, kind) == tuple(cases[0]):
        return os.path.join(out_dir, f"{prefix}.weights.h5")
    if f"{name} {kind}" in FULL:
        return os.path.join(out_dir, f"{prefix}-{name}-{kind}.weights.h5")
    return None


def train_cases(out_dir: str, cases: list, plans: list) -> None:
    """Wrap and train each case's model with its plan on this worker; write the results
    (losses, what ``scenario`` runs, the engine, variable devices, the audit) to
    ``out_dir/worker{task}.json``. The first case also runs fit/evaluate/predict/files."""
    from tfplan import apply
    from tfplan.apply.placement import variable_devices
    from tfplan.apply.spmd.input import local_parts, shards

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    results = {}
    for (name, kind), plan in zip(cases, plans):
        if os.environ.get("TFPLAN_TEST_TRACE"):
            print(f"worker {task}: {name} {kind}", file=sys.stderr, flush=True)
        module, model = base_model(name)
        wrapped = apply.wrap(model, plan)
        wrapped.compile(optimizer=optimizer_for(module, kind), loss=module.loss)
        result = scenario(wrapped, module, weights_file(out_dir, cases, name, kind),
                          f"{name} {kind}" in DATASETS)
        result.update(mode=type(wrapped).__name__, devices=variable_devices(wrapped),
                      weights=len(wrapped.trainable_variables),
                      slots=sum(1 for v in wrapped.optimizer.variables if len(v.shape)))
        run = getattr(wrapped, "run_description", None)  # the SPMD engine's (not remote)
        if run is not None:  # the parts of a batch this worker reads, of all
            result["reads"] = [len(local_parts(run)) if shards(run) else run.parts, run.parts]
        if f"{name} {kind}" in AUDITED:
            result["audit"] = _audit(wrapped, module, plan, task)
        results[f"{name} {kind}"] = result
    with open(os.path.join(out_dir, f"worker{task}.json"), "w", encoding="utf-8") as f:
        json.dump({"task": task, "results": results}, f)


def worker_main(out_dir: str) -> None:
    if os.environ.get("TFPLAN_TEST_TRACE"):  # where a hung worker waits, printed
        import faulthandler

        faulthandler.dump_traceback_later(int(os.environ["TFPLAN_TEST_TRACE"]), exit=True)
    from tfplan import apply
    from tfplan.planner.plan import load_plan

    with open(os.path.join(out_dir, "cases.json"), encoding="utf-8") as f:
        cases = [tuple(case) for case in json.load(f)]
    plans = [load_plan(os.path.join(out_dir, f"plan{i}.json")) for i in range(len(cases))]
    # the collective runtime and the CPUs, before any TF op: as many as any case uses
    apply.ensure_devices(max(plans, key=lambda p: max(int(d.rsplit(":", 1)[1])
                                                       for d in p.devices)))
    train_cases(out_dir, cases, plans)


def _reference(name: str, kind: str, weights_path: str | None) -> dict:
    module, copy = single_device_copy(name)
    copy.compile(optimizer=optimizer_for(module, kind), loss=module.loss)
    return scenario(copy, module, weights_path, f"{name} {kind}" in DATASETS)


def launch_with_references(script: str, out_dir, cases: list, workers: int = WORKERS
                           ) -> tuple[int, str, dict]:
    """``plan launch --workers W SCRIPT OUT_DIR``; while the workers run, the cases'
    single-device references are trained here. Returns (exit code, the end of the
    launch's output, {case: reference result})."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    launch = subprocess.Popen(
        [sys.executable, "-m", "tfplan.cli", "launch", "--workers", str(workers),
         os.path.abspath(script), str(out_dir)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # the single-device references, while the workers start
        references = {
            f"{name} {kind}": _reference(name, kind,
                                         weights_file(out_dir, cases, name, kind, "reference"))
            for name, kind in cases}
        out, err = launch.communicate(timeout=600)
    finally:
        if launch.poll() is None:
            launch.terminate()
            launch.wait()
    return launch.returncode, out + err, references


def run_cases(tmp_path, cases: list, workers: int, cpus: int) -> None:
    """Launch ``cases`` on ``workers`` workers of ``cpus`` CPUs; each worker's losses (and
    what ``scenario`` runs) equal one device's, every variable on one of its own planned
    devices, the audited cases' bytes within 10% of the plan's on each of its devices."""
    import numpy as np

    from tfplan.apply.mode import Processes, execution_mode
    from tfplan.planner.plan import save_plan

    plans = [worker_plan(base_model(name)[1], name, kind, workers, cpus)
             for name, kind in cases]
    for i, plan in enumerate(plans):  # the workers read them
        assert execution_mode(plan).processes is Processes.PER_WORKER, plan.name
        save_plan(plan, tmp_path / f"plan{i}.json")
    (tmp_path / "cases.json").write_text(json.dumps(cases), encoding="utf-8")
    returncode, logs, references = launch_with_references(__file__, tmp_path, cases, workers)
    assert returncode == 0, logs[-6000:]
    for task in range(workers):
        with open(tmp_path / f"worker{task}.json", encoding="utf-8") as f:
            doc = json.load(f)
        assert doc["task"] == task
        for (case, reference), plan in zip(references.items(), plans):
            result = doc["results"][case]
            assert result["mode"] == "SpmdModel", case
            for key in reference:
                np.testing.assert_allclose(result[key], reference[key], rtol=1e-4, atol=1e-6,
                                           err_msg=f"{case}: {key} (worker {task})")
            mine = {d for d in plan.devices if f"/task:{task}/" in d}
            for path, where in result["devices"].items():
                # the optimizer's step counter and learning rate: on the worker's host
                host = {dev(task, 0)} if path.endswith(("/iteration", "/learning_rate")) \
                    else set()
                assert where and set(where) <= mine | host, (case, path, where, sorted(mine))
            _check_stages(result["devices"], plan, task, case)
            read, parts = result["reads"]  # a column on every worker reads every batch
            assert (read < parts) == (not kind_spans_all(case)), (case, read, parts)
            for device, (measured, priced) in result.get("audit", {}).items():
                assert measured == pytest.approx(priced, rel=0.10), (case, device)
            assert ("audit" in result) == (case in AUDITED)
    for name, kind in cases:  # written once, by the chief: one device's weights and state
        path = weights_file(tmp_path, cases, name, kind)
        if path is not None:
            _assert_same_files(name, kind, path,
                               weights_file(tmp_path, cases, name, kind, "reference"))


def kind_spans_all(case: str) -> bool:
    """Whether a case's columns each lie on every worker (every worker reads every row)."""
    kind = case.split()[1]
    return kind in ("pp2", "pp2-interleaved", "pp2xtp2", "placement") or kind.startswith(
        "dp2xpp2-across")


def _check_stages(devices: dict, plan, task: int, case: str) -> None:
    """A stage's layers' variables on this worker's devices of that stage, and none of a
    stage with no device here (another worker's: not built into this worker's model)."""
    for stage in plan.stages:
        here = {d for d in stage.devices if f"/task:{task}/" in d}
        for layer in stage.layers:
            for path, where in devices.items():
                if path.split("/")[0] == layer:
                    assert here and set(where) <= here, (case, path, where, sorted(here))


def _assert_same_files(name: str, kind: str, path, reference) -> None:
    """The workers' weight file holds what one device's does: the weights and the
    optimizer's state (Adam's moments, its step), read into the plain model."""
    import numpy as np

    states = []
    for file in (path, reference):
        module, model = single_device_copy(name)
        model.compile(optimizer=optimizer_for(module, kind), loss=module.loss)
        model.optimizer.build(model.trainable_variables)
        model.load_weights(file)
        states.append([np.asarray(v) for v in [*model.weights, *model.optimizer.variables]])
    assert len(states[0]) == len(states[1])
    for got, want in zip(*states):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{name} {kind}")


def test_plans_over_two_workers_of_four_devices_train_like_one_device(tmp_path):
    run_cases(tmp_path, CASES, workers=2, cpus=4)


def test_tensor_ranks_across_four_workers_of_two_devices_train_like_one_device(tmp_path):
    run_cases(tmp_path, FOUR_CASES, workers=4, cpus=2)


def test_pipeline_stages_across_workers_train_like_one_device(tmp_path):
    run_cases(tmp_path, PIPE_CASES, workers=2, cpus=2)


def launch_train_script(tmp_path, *args: str, printing: tuple[int, ...] = (0, 1)) -> dict:
    """``plan launch --workers 2 examples/train.py ARGS --json``: each worker's result
    (``printing``: the workers expected to print one)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    env.pop("PLAN_FILE", None)
    launch = subprocess.run(
        [sys.executable, "-m", "tfplan.cli", "launch", "--workers", str(WORKERS),
         os.path.join(ROOT, "examples", "train.py"), "--model",
         os.path.join(HERE, "tiny_mlp.py"), "--json", *args],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert launch.returncode == 0, launch.stdout[-2000:] + launch.stderr[-4000:]
    results = {}
    for line in launch.stdout.splitlines():
        prefix, _, rest = line.partition("] ")
        if rest.startswith("{"):
            results[int(prefix.split()[-1])] = json.loads(rest)
    assert sorted(results) == list(printing), launch.stdout[-2000:]
    return results


def _train_script_results(tmp_path, kind: str) -> dict:
    """``examples/train.py`` under ``plan launch --workers 2 --plan P`` (P: the MLP's
    ``kind`` plan): every worker's result, its plan and losses checked against the single
    device's (helpers.reference_losses)."""
    from tfplan.planner.plan import save_plan
    from tests.apply.helpers import STEPS as REFERENCE_STEPS, assert_losses_match, \
        reference_losses

    _, model = base_model("tiny_mlp")
    save_plan(worker_plan(model, "tiny_mlp", kind), tmp_path / "plan.json")
    results = launch_train_script(tmp_path, "--plan", str(tmp_path / "plan.json"),
                                  "--steps", str(REFERENCE_STEPS))
    for result in results.values():
        assert result["plan"] == f"tiny_mlp {kind} over 2 workers"
        assert_losses_match(result["losses"], reference_losses("tiny_mlp"))
    return results


def test_train_script_with_a_hybrid_plan_under_plan_launch(tmp_path):
    """``plan launch --workers 2 examples/train.py --plan P`` with a dp2 x pp2 plan: both
    workers train with the single-device losses."""
    for task, result in _train_script_results(tmp_path, "dp2xpp2").items():
        assert result["devices"]["dense_in/kernel"] == [dev(task, 0)]


def test_train_script_with_a_pipeline_across_workers_under_plan_launch(tmp_path):
    """``plan launch --workers 2 examples/train.py --plan P``, P a pipeline with one stage
    per worker: both workers train (one program each) with the single-device losses, each
    holding its own stage's weights."""
    results = _train_script_results(tmp_path, "pp2")
    assert results[1]["devices"]["head/kernel"] == [dev(1, 0)]
    assert "head/kernel" not in results[0]["devices"]


def test_apply_auto_plans_the_multi_worker_job(tmp_path):
    """``plan launch --workers 2 examples/train.py --auto --cpus 2``: each worker plans
    for ``2xcpu:2`` (apply.auto with TF_CONFIG), both pick the same plan, which runs
    across the workers, and train with the single-device losses."""
    from tests.apply.helpers import GLOBAL_BATCH as REFERENCE_BATCH, STEPS as REFERENCE_STEPS, \
        assert_losses_match, reference_losses

    results = launch_train_script(tmp_path, "--auto", "--cpus", str(CPUS), "--global-batch",
                                   str(REFERENCE_BATCH), "--steps", str(REFERENCE_STEPS))
    plans = {result["plan"] for result in results.values()}
    assert len(plans) == 1, plans
    for task, result in results.items():
        assert_losses_match(result["losses"], reference_losses("tiny_mlp"))
        used = {d for where in result["devices"].values() for d in where}
        assert used and all(f"/job:worker/task:{task}/" in d for d in used), used


if __name__ == "__main__":
    worker_main(sys.argv[1])
