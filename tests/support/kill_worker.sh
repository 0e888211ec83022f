#!/bin/sh
# The interpreter a kill sweep's `fp8conv convert -j N` starts its workers with (kill_sweep.py): the
# worker runs as `python -I -m fp8conv part-worker JOB` would, armed first to be killed at a moment.
# "$@" is what fp8conv passes its interpreter: -I -m fp8conv part-worker JOB.
shift 3
exec "$KILL_SWEEP_PYTHON" -I -c '
import runpy, sys
sys.path.insert(0, sys.argv.pop(1))
from tests.support.kill_sweep import arm_worker
arm_worker()
del sys.path[0]
runpy.run_module("fp8conv", run_name="__main__", alter_sys=True)
' "$KILL_SWEEP_REPO" "$@"
