"""``plan analyze``'s text in a terminal: the candidate table fits 80 columns with no
number cut (fewer columns by default, ``--wide`` for all), the same at 120 columns and
piped; predicted TFLOP/s per device and MFU in the table and in ``--json``; the listing
is really ranked and ends with what to do next.

In-process (``tfplan.cli.main``), as tests/cli/test_input_shape_cli.py runs it; rich
reads the width from ``COLUMNS`` (set per test), and stdout is not a terminal here.
"""
from __future__ import annotations

import json
import re

import pytest

from tests.cli.helpers import run
from tfplan.reports.tables import CANDIDATE_HEADER, SHORT_HEADER

ARGS = ["analyze", "examples/mlp.py", "--cluster", "cpu:4", "--global-batch", "64"]
# a cell of the table: between two box-drawing bars
BAR = "│"


def analyze(tmp_path, monkeypatch, columns: int | None, *flags: str) -> str:
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", str(columns))
    code, out, err = run([*ARGS, "--out", str(tmp_path / "out"), *flags])
    assert code == 0, err
    return out


def table_rows(text: str) -> list[list[str]]:
    """The cells of every body row of every table (rows that start with a bar)."""
    return [[c.strip() for c in line.strip().strip(BAR).split(BAR)]
            for line in text.splitlines() if line.startswith(BAR)]


def header_cells(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if line.startswith("┃"))


def check_numbers_whole(text: str) -> None:
    """No '…' anywhere in a table, and every number cell reads as a whole number with
    its unit (a cut one would be empty, 's…' or '5.89 G…')."""
    assert "…" not in text, text
    rows = [r for r in table_rows(text) if r[1]]  # a row's first line (it has a rank)
    assert rows, text
    for cells in rows:
        step, tflops, mfu, memory, fits = cells[3:8]
        assert re.fullmatch(r"\d+(\.\d+)? (s|ms|µs)", step), cells
        assert re.fullmatch(r"\d+(\.\d+)?(e-\d+)?", tflops), cells
        assert re.fullmatch(r"\d+(\.\d+)?%", mfu), cells
        assert re.fullmatch(r"\d+(\.\d+)? (B|KiB|MiB|GiB)", memory), cells
        assert fits in ("yes", "NO"), cells


@pytest.mark.parametrize("columns", [80, 120])
def test_the_table_fits_the_terminal_with_every_number_whole(tmp_path, monkeypatch, columns):
    out = analyze(tmp_path, monkeypatch, columns)
    # every line fits but the next steps' commands (indented 4), never broken in two
    lines = [line for line in out.splitlines() if not line.startswith("    ")]
    assert all(len(line) <= columns for line in lines), max(lines, key=len)
    assert all(line.startswith(("    model = apply.wrap(", "    python ", "    tensorboard ",
                                "    plan "))
               for line in out.splitlines() if line.startswith("    "))
    check_numbers_whole(out)
    headers = header_cells(out)
    for column in ("strategy", "MFU", "fits", "TFLOP/s"):
        assert column in headers
    assert "capacity" not in headers and "samples/s" not in headers  # --wide only


def test_piped_output_has_every_number_whole(tmp_path, monkeypatch):
    out = analyze(tmp_path, monkeypatch, None)
    check_numbers_whole(out)
    assert all(len(line) <= 220 for line in out.splitlines())


@pytest.mark.parametrize("columns", [80, None])
def test_wide_shows_every_column_and_cuts_no_number(tmp_path, monkeypatch, columns):
    out = analyze(tmp_path, monkeypatch, columns, "--wide")
    assert "…" not in out
    headers = header_cells(out)
    for column in ("micro", "compute", "comm", "bubble", "recompute", "optimizer",
                   "overhead", "capacity", "samples/s", "MFU", "peak mem"):
        assert column in headers, column
    rows = [r for r in table_rows(out) if r[1]]
    assert all(len(r) == len(CANDIDATE_HEADER) for r in rows)
    assert len(SHORT_HEADER) < len(CANDIDATE_HEADER)


def test_the_listing_is_ranked_and_ends_with_the_next_steps(tmp_path, monkeypatch):
    out = analyze(tmp_path, monkeypatch, 100)
    rows = [r for r in table_rows(out) if r[1]]
    assert [int(r[1]) for r in rows] == list(range(1, len(rows) + 1))
    assert sum(r[0] == "*" for r in rows) == 1
    # ranked: step times never decrease down the table of the plans that fit
    scale = {"s": 1.0, "ms": 1e-3, "µs": 1e-6}
    times = [float(r[3].split()[0]) * scale[r[3].split()[1]] for r in rows if r[7] == "yes"]
    assert times == sorted(times)
    assert "ranked by predicted step time" in out
    tail = out[out.index("Next steps:"):]
    plan = str(tmp_path / "out" / "plan.json")
    assert f'apply.wrap(model, "{plan}")' in tail
    assert f"python examples/train.py --model examples/mlp.py --plan {plan}" in tail
    assert f"tensorboard --logdir {tmp_path / 'out' / 'tensorboard'}" in tail
    assert f"plan report {tmp_path / 'out'} --html" in tail
    assert "plan launch" not in tail  # one worker: nothing to launch


def test_json_gives_each_candidate_its_mfu(tmp_path, monkeypatch):
    code, out, err = run([*ARGS, "--out", str(tmp_path / "out"), "--json"])
    assert code == 0, err
    doc = json.loads(out)
    for plan in [doc["plan"], *doc["candidates"]]:
        assert 0 < plan["mfu"] < 1
        assert plan["mfu"] == pytest.approx(plan["predicted"]["model_tflops_per_device"]
                                            / plan["peak_tflops_per_device"])
    peak = doc["plan"]["cluster"]["device"]["peak_flops_per_s"]["float32"]
    assert doc["plan"]["peak_tflops_per_device"] == pytest.approx(peak / 1e12)


def test_a_plan_across_workers_says_how_to_launch_it(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = run(["analyze", "examples/mlp.py", "--cluster", "2xcpu:1", "--fix", "dp=2",
                          "--global-batch", "32", "--out", str(tmp_path / "out")])
    assert code == 0, err
    assert (f"plan launch --workers 2 examples/train.py --model examples/mlp.py --plan "
            f"{tmp_path / 'out' / 'plan.json'}") in out
    assert "    python examples/train.py" not in out  # one process cannot run it


def test_plan_profile_and_clusters_keep_their_numbers_whole_at_80_columns(monkeypatch):
    """Every CLI table, not only analyze's, prints a number whole: at 80 columns
    ``plan profile`` once cut its forward FLOPs ('854.…') and names ('TOT…')."""
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run(["profile", "examples/cnn.py"])
    assert code == 0, err
    assert "…" not in out, out
    (total,) = [r for r in table_rows(out) if r[0] == "TOTAL"]
    assert total[2] == "5,322" and total[-2] == "854.54 K", total
    code, out, err = run(["clusters"])
    assert code == 0, err
    assert "…" not in out and "8xA100-80GB" in out, out
