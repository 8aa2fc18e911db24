#!/bin/bash
# Rehearses runbooks/cross-region.md on one CPU machine: bring-up, status, drain, a worker joined by
# hand, losing every process (controller included) mid-run, verifying the newest checkpoint and
# resuming it on a different cluster shape; then an uninterrupted reference run to compare with.
#   bash scripts/runbook_rehearsal.sh [WORKDIR]     (~6 min on 2 cores; default: a new private temp dir)
set -u
# WORKDIR is against the directory you run this from (before the cd below), and must be new or
# empty: the rehearsal never deletes a directory it did not make.
case "${1:-}" in
  -h|--help) sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit 0;;
  -*) echo "error: unknown option $1; usage: bash scripts/runbook_rehearsal.sh [WORKDIR]" >&2; exit 2;;
esac
if [ $# -ge 1 ]; then
  RB=$(realpath -m -- "$1")
  if [ -e "$RB" ] && [ ! -d "$RB" ]; then
    echo "error: WORKDIR $RB is a file; name a new or empty directory" >&2
    exit 2
  fi
  if [ -e "$RB" ] && [ -n "$(ls -A -- "$RB" 2>/dev/null)" ]; then
    echo "error: WORKDIR $RB is not empty; name a new or empty directory (the rehearsal writes its runs there)" >&2
    exit 2
  fi
  mkdir -p -- "$RB" || exit 2
else
  # A fixed name under /tmp could be another account's directory (holding the run, and the compile
  # cache whose entries the run executes): the default is a fresh one only this account can write.
  RB=$(mktemp -d -t runbook-rehearsal-XXXXXX) || exit 1
fi
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
echo "rehearsal directory: $RB"
FAILED=""  # the steps whose exit status was wrong; the rehearsal fails if any was
expect() { # what status step: records a step whose exit status is not the expected one
  [ "$2" -eq "$1" ] || FAILED="$FAILED $3(exit $2)"; }
# Whatever ends the rehearsal (a step that never comes, Ctrl-C), the runs it started are stopped:
# SIGTERM is a preemption to a driver, which stops its workers and exits.
trap 'kill $(jobs -p) 2>/dev/null' EXIT
wait_step() { # run_dir step: until the run reports that step (5 min at most), else the rehearsal fails
  for i in $(seq 1 600); do
    s=$($PY -c "import json,sys; print(json.load(open('$1/elastic/status.json'))['step'])" 2>/dev/null || echo -1)
    [ "$s" -ge "$2" ] && return 0; sleep 0.5; done
  echo "error: $1 did not reach step $2 in 5 min; see its log in $RB" >&2; exit 1; }
echo "== bring-up + status + drain + manual join"
$PY -m resilient_jax.train --config configs/cpu-4host.yaml --set run.dir=$RB/run --set train.steps=150 > $RB/train.log 2>&1 &
TRAIN=$!
wait_step $RB/run 10
$PY -m resilient_jax.elastic status --run $RB/run
$PY -m resilient_jax.elastic drain --run $RB/run --host h2; rc=$?; echo "drain exit $rc"; expect 0 $rc drain
wait_step $RB/run 40
URL=$($PY -c "import json; print(json.load(open('$RB/run/elastic/controller.json'))['url'])")
RESILIENT_JAX_TOKEN=$(cat $RB/run/elastic/token) $PY -m resilient_jax.elastic worker --controller $URL --host h50 --region eu --config-json $RB/run/elastic/config.json --devices 2 > $RB/h50.log 2>&1 &
wait $TRAIN; rc=$?; echo "train exit $rc"; expect 0 $rc bring-up-run
$PY -m resilient_jax.elastic status --run $RB/run
$PY -c "import json; s=json.load(open('$RB/run/summary.json')); print([(e['reason'], e['reslotted'], e['joined'], e['lost']) for e in s['events']], s['steps_lost'], s['restarts'], s['params_fingerprint'][:16])"
echo "== lose everything (controller included) mid-run, resume on a different cluster shape"
$PY -m resilient_jax.train --config configs/cpu-4host.yaml --set run.dir=$RB/lost --set train.steps=60 --set checkpoint.every_steps=10 > $RB/lost.log 2>&1 &
LOST=$!
wait_step $RB/lost 35
pkill -9 -f "run.dir=$RB/lost"; pkill -9 -f "$RB/lost/elastic/config.json"; sleep 1
ls $RB/lost/checkpoints
# The root resolves to its newest COMMITTED step (a step killed before its commit files is not one).
$PY -m resilient_jax.checkpoint verify $RB/lost/checkpoints; rc=$?; echo "verify exit $rc"; expect 0 $rc verify
$PY -m resilient_jax.train --config configs/cpu-6host-3region.yaml --set run.dir=$RB/lost --set train.steps=60 --set checkpoint.every_steps=10 2>&1 | tail -3
$PY -c "import json; s=json.load(open('$RB/lost/summary.json')); print('resumed run:', s['final_step'], s['params_fingerprint'][:16], s['processes'])"
echo "== reference: 60 steps uninterrupted"
$PY -m resilient_jax.train --config configs/cpu-4host.yaml --set run.dir=$RB/ref --set train.steps=60 --set checkpoint.enabled=false 2>&1 | tail -1
# The rehearsal holds when the run that lost everything ended on the uninterrupted trajectory.
$PY -c "
import json, sys
lost, ref = (json.load(open('$RB/' + d + '/summary.json'))['params_fingerprint'] for d in ('lost', 'ref'))
print('rehearsal:', 'the resumed run ends on the reference fingerprint' if lost == ref else 'FAILED: fingerprints differ')
sys.exit(lost != ref)" || FAILED="$FAILED fingerprint"
if [ -n "$FAILED" ]; then echo "rehearsal FAILED:$FAILED" >&2; exit 1; fi
echo "rehearsal: every step held"
