"""`cleave ARGS` refused before it does any work, checked in this process: a child process per
case would import PyTorch each time (seconds of CPU on a 2-core machine) to print one line.
The exit status and message are the CLI's (`cleave.cli.main` returns what the process exits
with); tests of the process itself (no traceback, exit codes) keep a child process."""

from __future__ import annotations

import contextlib
import io


def refused(*args: str) -> str:
    """Runs `cleave ARGS` in this process; asserts it exits with 2 (a usage error) and returns
    what it wrote to stderr."""
    from cleave.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = main(list(args))
        except SystemExit as exit:  # argparse's own errors exit
            status = exit.code
    assert status == 2, (args, status, err.getvalue()[-2000:])
    return err.getvalue()
