"""A process that imports TensorFlow and the ``plan`` command once, then forks a child per
request that runs ``tfplan.cli.main(argv)`` -- exactly what the ``plan`` entry point runs
-- so tests/cli/test_atomic_analyze.py can start (and SIGKILL) twenty ``plan analyze``
runs without paying TensorFlow's import (about 5 s) twenty times.

Protocol, one JSON object per line: the test writes ``{"argv": [...], "log": path}``; this
process answers ``{"pid": child}`` at once and ``{"pid": child, "status": wait status}``
when the child has ended (exited or killed). Nothing TensorFlow runs here before a fork:
only imports, so each child starts its own runtime.
"""
from __future__ import annotations

import json
import os
import sys


def main() -> None:
    # The imports every child would otherwise pay for (about 1 s of a run's 1.3 s beyond
    # TensorFlow's own): the planner's scipy, the pictures' PIL, the tables' rich, and the TensorBoard
    # summary modules tf.summary loads lazily on first use. Imports only, no op.
    import keras  # noqa: F401
    import PIL.ImageDraw  # noqa: F401
    import PIL.ImageFont  # noqa: F401
    import rich.console  # noqa: F401
    import rich.table  # noqa: F401
    import scipy.optimize  # noqa: F401
    import tensorboard.plugins.image.summary_v2  # noqa: F401
    import tensorboard.plugins.scalar.summary_v2  # noqa: F401
    import tensorboard.plugins.text.summary_v2  # noqa: F401
    import tensorboard.summary  # noqa: F401
    import tensorflow as tf

    import tfplan.cli as cli
    from tfplan.planner import search  # noqa: F401
    from tfplan.profiler import loader, static  # noqa: F401
    from tfplan.reports import analysis_dir, plugin, tensorboard  # noqa: F401

    for name in ("create_file_writer", "text", "scalar", "image"):
        getattr(tf.summary, name)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            try:
                rc = cli.main(request["argv"])
            except BaseException:  # a bug: show it in the log, exit 1 like the entry point
                import traceback
                traceback.print_exc()
                rc = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "status": status}), flush=True)


if __name__ == "__main__":
    main()
