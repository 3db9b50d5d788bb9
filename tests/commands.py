"""Several command lines run one after another in one child process.

Each ``python FILE ARGS`` or ``python -m MODULE ARGS`` runs as Python itself runs it (runpy, as
``__main__``), so the commands share one start of Python and JAX. One stream of each command
(file descriptor 1 or 2, what C++ libraries write included) goes to a file of its own; what the
process writes to it besides stays with the child.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A collection at the end takes whatever the commands left to the garbage collector, so what it
# would print shows in the child's own stream, not only when the collector happens to run.
RUN_EACH = textwrap.dedent(
    """
    import gc, json, os, runpy, sys
    fd, commands = json.loads(sys.argv[1])
    stream = (sys.stdout, sys.stderr)[fd - 1]
    report = []
    for argv, path in commands:
        stream.flush()
        console = os.dup(fd)
        with open(path, "w") as f:
            os.dup2(f.fileno(), fd)
            try:
                if argv[1] == "-m":
                    sys.argv = [argv[2], *argv[3:]]
                    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
                else:
                    sys.argv = argv[1:]
                    runpy.run_path(argv[1], run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code
            finally:
                stream.flush()
                os.dup2(console, fd)
                os.close(console)
        report.append(code)
    gc.collect()
    print("REPORT" + json.dumps(report))
    """
)


def run_each(argvs, outputs, *, fd: int = 1, env=None) -> tuple[list[str], list, str]:
    """Runs ``argvs`` (each ``["python", ...]``) by :data:`RUN_EACH` in one child process, file
    descriptor ``fd`` of each going to its file in ``outputs``.

    Returns each command's output, each exit code (``None`` or 0 for success), and what the
    child wrote to stderr besides.
    """
    outputs = [str(o) for o in outputs]
    proc = subprocess.run(
        [sys.executable, "-c", RUN_EACH, json.dumps([fd, list(zip(argvs, outputs, strict=True))])],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    texts = [Path(o).read_text() if Path(o).exists() else "" for o in outputs]
    assert "REPORT" in proc.stdout, (proc.stdout[-2000:], proc.stderr[-3000:], texts)
    return texts, json.loads(proc.stdout.split("REPORT", 1)[1]), proc.stderr
