"""The `fp8conv` command's process (and `python -m fp8conv`): the CLI, then an exit that skips tearing
the interpreter down.

After a conversion, Python's own shutdown (every module torch loaded, its objects, its C++ statics)
took ~0.5 s of a 2-core machine (measured: `import torch` then exit, 0.49-0.57 s; os._exit, 0.01-0.02 s),
and nothing in it is needed: by then every output file is written, synced and renamed, and the summary
printed. So once the command has finished, the exit handlers run, the streams are flushed and the
process ends with the command's status. While any other non-daemon thread is alive the ordinary exit
runs instead (it waits for them).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn

from .commands import main


def run() -> NoReturn:
    try:
        main()
    except SystemExit as done:  # click ends every command with one, errors included
        if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.current_thread()):
            raise
        status = _status(done.code)
    else:  # pragma: no cover - click's standalone mode always exits
        status = 0
    atexit._run_exitfuncs()  # what libraries registered (log handlers' flush and the like)
    for stream in (sys.stdout, sys.stderr):  # click.echo flushes; anything else written is flushed here
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more can be said there
            stream.flush()
    os._exit(status)


def _status(code: object) -> int:
    """As Python's exit would: None is 0, an int itself, anything else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
