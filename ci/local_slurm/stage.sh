#!/usr/bin/env bash
# The local-Slurm CI stage: a real SkyPilot launch and teardown on 127.0.0.1.
#
# Skips (exit 0, one line) without root or apt-get. Otherwise: records the
# listening sockets (baseline), samples them every second in the background
# (ci/local_slurm/listeners.py; other processes' listeners are reported apart),
# runs setup.sh, the `slurm`-marked tests (happy path; chaos cases too unless
# RTV_SLURM_CHAOS=0), and always teardown.sh (trap), then fails if anything
# listened on a non-loopback address that the baseline did not have.
# Output (logs, receipts, samples) goes to rtv-out/local_slurm/<UTC time>/.
# Usage: ci/local_slurm/stage.sh   (RTV_PYTHON: the project's python; default .venv/bin/python;
#        RTV_SLURM_CASES: a pytest -k expression selecting cases, e.g. for a negative control)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export RTV_REPO=${RTV_REPO:-$(cd "$here/../.." && pwd)}

skip() { echo "local_slurm stage: SKIPPED: $*"; exit 0; }
[ "$(id -u)" = 0 ] || skip "needs root to install Slurm and run its daemons (running as uid $(id -u))"
command -v apt-get >/dev/null || skip "needs apt-get to install Debian's slurm-wlm, munge, openssh-server, rsync"
command -v ss >/dev/null || skip "needs ss (iproute2) to watch listening sockets"

source "$here/common.sh"
export RTV_PYTHON RTV_SLURM_USER RTV_JOB_VENV=$JOB_VENV RTV_SLURM_CHAOS=${RTV_SLURM_CHAOS:-1}
out=$RTV_REPO/rtv-out/local_slurm/$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out"
ss -ltnuH >"$out/listeners-baseline.txt"
export RTV_LOCAL_SLURM_STAGE=$out   # every process the stage starts inherits this marker
(cd "$RTV_REPO" && PYTHONPATH=$RTV_REPO exec "$RTV_PYTHON" -m ci.local_slurm.listeners sample \
    "$out/listeners.txt" --job-user "$RTV_SLURM_USER") &
sampler=$!
t0=$SECONDS

finish() {
    local rc=$? listeners_rc=0
    trap - EXIT
    "$here/teardown.sh" || rc=1
    kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null || true
    (cd "$RTV_REPO" && PYTHONPATH=$RTV_REPO "$RTV_PYTHON" -m ci.local_slurm.listeners check \
        "$out/listeners-baseline.txt" "$out/listeners.txt") || listeners_rc=1
    [ $listeners_rc = 0 ] || rc=1
    echo "local_slurm stage: $([ $rc = 0 ] && echo PASSED || echo FAILED) in $((SECONDS - t0)) s; output: $out"
    exit $rc
}
trap finish EXIT

"$here/setup.sh"
log "setup took $((SECONDS - t0)) s"
client_env auditor   # the tests' own probes: a third identity, neither the launcher nor the one that downs
export RTV_LOCAL_SLURM=1 RTV_SLURM_OUT=$out RTV_SKY_CLIENTS=$SKY_CLIENTS RTV_COMMON_SH=$here/common.sh
cd "$RTV_REPO"
"$RTV_PYTHON" -m pytest -p no:xdist -p no:cacheprovider -s -q -o addopts= -rA tests/ci/test_local_slurm_stage.py \
    ${RTV_SLURM_CASES:+-k "$RTV_SLURM_CASES"}
