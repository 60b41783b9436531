"""Running the CLI in this process for the tests (a subprocess would import TensorFlow
again for every case)."""
from __future__ import annotations

import contextlib
import io

import tfplan.cli as cli


def run(argv: list[str]) -> tuple[int, str, str]:
    """``plan ARGV`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse usage errors
            code = e.code if isinstance(e.code, int) else 2
    return code, out.getvalue(), err.getvalue()
