#!/usr/bin/env bash
# make slurm-test: the Slurm fan-out example, run for real on a one-node Slurm started here.
#
# Starts munged, slurmctld and slurmd (Debian's slurm-wlm and munge, installed when missing) with a
# slurm.conf for this node's real CPUs and memory, on ports and paths of their own; submits
# examples/fanout/slurm_array.sbatch as written, with the overrides a small node needs on the sbatch
# command line; cancels one array task mid-shard; checks that the dependent finalize job is cancelled
# (--kill-on-invalid-dep=yes), reruns only that task, finalizes as a dependent job (finalize, verify);
# then compares the output with one process, byte for byte. Every daemon it started is stopped on exit.
# Needs root. Without root it says so and exits 0, or 1 when SLURM_TEST_REQUIRED=1 (CI).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=$REPO/.venv/bin/python
N=3             # parts: the tiny checkpoint has 4 shards
KILLED=3        # the task cancelled mid-shard: its part has two shards, the first one finishes first
START=$(date +%s)

say() { echo "slurm-test: $*"; }
if [[ $(id -u) -ne 0 ]]; then
    say "cannot run: it needs root to install slurm-wlm and munge and to start munged, slurmctld and slurmd"
    exit "${SLURM_TEST_REQUIRED:-0}"
fi
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    say "installing slurm-wlm and munge"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi

WORK=$(mktemp -d /tmp/fp8conv-slurm.XXXXXX)
chmod 755 "$WORK"
export SLURM_CONF=$WORK/slurm.conf
cleanup() {
    local rc=$?
    set +e
    [[ -f $WORK/slurmctld.pid ]] && scancel --quiet --user=root 2>/dev/null # this private cluster's jobs
    for daemon in slurmd slurmctld munged; do
        if [[ -f $WORK/$daemon.pid ]]; then
            pid=$(cat "$WORK/$daemon.pid")
            kill "$pid" 2>/dev/null
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null
        fi
    done
    if ((rc != 0)); then
        say "FAILED; daemon logs and job output:"
        tail -n 20 "$WORK"/*.log "$WORK"/run/*.out 2>/dev/null
    fi
    [[ -n ${SLURM_TEST_KEEP:-} ]] && say "kept $WORK" || rm -rf "$WORK"
    say "took $(($(date +%s) - START)) s"
    exit "$rc"
}
trap cleanup EXIT

# munge, on a socket and key of its own
mkdir -p "$WORK/munge" "$WORK/state" "$WORK/spool" "$WORK/run"
chmod 700 "$WORK/munge"
dd if=/dev/urandom of="$WORK/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$WORK/munge/munge.key"
munged --force --socket="$WORK/munge/munge.socket" --key-file="$WORK/munge/munge.key" \
    --pid-file="$WORK/munged.pid" --seed-file="$WORK/munge/seed" --log-file="$WORK/munged.log"

# one node: this machine, with the CPUs and memory slurmd finds on it
NODE=$(slurmd -C | head -1)
NODENAME=$(sed -E 's/^NodeName=([^ ]+).*/\1/' <<<"$NODE")
cat >"$SLURM_CONF" <<CONF
ClusterName=fp8conv-test
SlurmctldHost=$NODENAME(127.0.0.1)
SlurmctldPort=26817
SlurmdPort=26818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$WORK/munge/munge.socket
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/slurmctld.log
SlurmdLogFile=$WORK/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
KillWait=2
MinJobAge=600
$NODE NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 100); do
    sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)' && break
    sleep 0.2
done
say "one node up: $(sinfo -h -o '%N %c CPUs %m MB %T')"

# the input, and the reference: one process
export SRC=$WORK/tiny-fp8 OUT=$WORK/out N
PYTHONPATH="$REPO" "$PY" -c "import sys; from tests.support.synthetic import build_tiny_deepseek; build_tiny_deepseek(sys.argv[1], num_shards=4)" "$SRC"
"$REPO/.venv/bin/fp8conv" convert "$SRC" --to bf16 -o "$WORK/single" --quiet

# fp8conv as the example expects it: a venv's bin/fp8conv. This one is the repo's .venv, except that the
# first run of task $KILLED holds each finished shard 3 s before its rename, so it can be cancelled mid-shard.
mkdir -p "$WORK/venv/bin"
cat >"$WORK/venv/bin/fp8conv" <<SHIM
#!/bin/bash
if [[ \${SLURM_ARRAY_TASK_ID:-} == $KILLED && ! -e $WORK/cancelled ]]; then
    exec "$PY" -c '
import sys, time
import fp8conv.storage.writer as writer
commit = writer.ShardWriter.commit
def slow_commit(self):
    time.sleep(3)
    commit(self)
writer.ShardWriter.commit = slow_commit
from fp8conv.cli.commands import main
sys.argv[0] = "fp8conv"
main()
' "\$@"
fi
exec "$REPO/.venv/bin/fp8conv" "\$@"
SHIM
chmod +x "$WORK/venv/bin/fp8conv"
export FP8CONV_VENV=$WORK/venv

# the overrides a small node needs; everything else comes from the #SBATCH lines
SMALL=(--cpus-per-task=1 --mem=1G --time=00:10:00)
cd "$WORK/run"
wait_done() { # job id: until squeue no longer lists it
    for _ in $(seq 600); do
        [[ -z $(squeue -h -j "$1" 2>/dev/null) ]] && return 0
        sleep 0.5
    done
    say "job $1 did not finish in 5 min"
    return 1
}
job_field() { scontrol show job "$1" | tr ' ' '\n' | grep "^$2=" | head -1 | cut -d= -f2; }

JOBID=$(sbatch --parsable "${SMALL[@]}" --array=1-$N "$REPO/examples/fanout/slurm_array.sbatch")
FIN=$(sbatch --parsable "${SMALL[@]}" --dependency=afterok:"$JOBID" --kill-on-invalid-dep=yes \
    "$REPO/examples/fanout/slurm_finalize.sbatch")
say "array job $JOBID (tasks 1-$N), finalize job $FIN after it"
RECORD=$OUT/.fp8conv/part-$KILLED-of-$N.json
for _ in $(seq 600); do # until task $KILLED has finished one shard and is writing the next
    if [[ -f $RECORD ]] && compgen -G "$OUT/.*.fp8conv-partial" >/dev/null &&
        "$PY" -c "import json, sys; sys.exit(len(json.load(open(sys.argv[1]))['shards']) != 1)" "$RECORD"; then
        break
    fi
    [[ -z $(squeue -h -j "${JOBID}_$KILLED" 2>/dev/null) ]] && break # it ended by itself: checked below
    sleep 0.2
done
touch "$WORK/cancelled"
scancel "${JOBID}_$KILLED"
wait_done "$JOBID"
wait_done "$FIN"
FINISHED=$("$PY" -c "import json, sys; print(*json.load(open(sys.argv[1]))['shards'])" "$RECORD")
say "cancelled task ${JOBID}_$KILLED mid-shard: finished $FINISHED, left $(cd "$OUT" && echo .*.fp8conv-partial)"
compgen -G "$OUT/.*.fp8conv-partial" >/dev/null
for i in $(seq $N); do say "task $i: $(job_field "${JOBID}_$i" JobState)"; done
[[ $(job_field "${JOBID}_$KILLED" JobState) == CANCELLED ]]
say "finalize job $FIN: $(job_field "$FIN" JobState) ($(job_field "$FIN" Reason))"
[[ $(job_field "$FIN" JobState) == CANCELLED && ! -e $OUT/config.json ]]

# rerun only the cancelled task, N unchanged; then finalize and verify as a dependent job
RERUN=$(sbatch --parsable "${SMALL[@]}" --array=$KILLED "$REPO/examples/fanout/slurm_array.sbatch")
FIN=$(sbatch --parsable "${SMALL[@]}" --dependency=afterok:"$RERUN" --kill-on-invalid-dep=yes \
    "$REPO/examples/fanout/slurm_finalize.sbatch")
wait_done "$RERUN"
wait_done "$FIN"
say "rerun ${RERUN}_$KILLED: $(job_field "${RERUN}_$KILLED" JobState): $(cat "fp8conv-${RERUN}_$KILLED.out")"
say "finalize job $FIN: $(job_field "$FIN" JobState): $(tr '\n' ' ' <"fp8conv-$FIN-finalize.out")"
[[ $(job_field "${RERUN}_$KILLED" JobState) == COMPLETED && $(job_field "$FIN" JobState) == COMPLETED ]]
grep -q "(1 kept from an earlier run)" "fp8conv-${RERUN}_$KILLED.out"
grep -q "^verify ok" "fp8conv-$FIN-finalize.out"

# byte for byte against one process: every file but the parts' own records
cd "$WORK"
(cd single && find . -type f | sort) >single.list
(cd out && find . -type f ! -name 'part-*-of-*.json' | sort) >out.list
diff single.list out.list
while read -r f; do cmp "single/$f" "out/$f"; done <single.list
say "byte-identical to one process: $(wc -l <single.list) files, $(cd single && cat $(cat ../single.list) | wc -c) bytes"
(cd out && sha256sum $(cat ../out.list)) | sed 's/^/  /'
say "ok"
