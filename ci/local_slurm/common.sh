# Settings shared by setup.sh, teardown.sh and stage.sh (sourced, never run).
#
# Everything the stage creates lives under $RTV_SLURM_WORK, runs on 127.0.0.1
# and is recorded by a pid file there, so teardown.sh can stop it by pid.
# Each name below can be overridden from the environment.

RTV_SLURM_WORK=${RTV_SLURM_WORK:-/tmp/rtv-local-slurm}
RTV_SLURM_USER=${RTV_SLURM_USER:-rtvslurm}          # unprivileged job user
RTV_SLURM_CLUSTER=${RTV_SLURM_CLUSTER:-rtvlocal}    # Slurm ClusterName = Host in ~/.slurm/config
RTV_SLURM_CTLD_PORT=${RTV_SLURM_CTLD_PORT:-46817}
RTV_SLURM_SLURMD_PORT=${RTV_SLURM_SLURMD_PORT:-46818}
RTV_SLURM_SSHD_PORT=${RTV_SLURM_SSHD_PORT:-46822}
RTV_SLURM_API_PORT=${RTV_SLURM_API_PORT:-46877}     # private SkyPilot API server
# SkyPilot runs from the project's own environment (the repo's .venv in CI).
RTV_PYTHON=${RTV_PYTHON:-$RTV_REPO/.venv/bin/python}

SLURM_DIR=$RTV_SLURM_WORK/slurm
SSHD_DIR=$RTV_SLURM_WORK/sshd
SKY_DIR=$RTV_SLURM_WORK/sky          # the API server's own HOME and SKY_RUNTIME_DIR (a service, as a team runs it)
SKY_CLIENTS=$RTV_SLURM_WORK/clients  # one HOME and SKY_RUNTIME_DIR per client identity (runner A, runner B, auditor)
JOB_HOME=$RTV_SLURM_WORK/jobhome
JOB_VENV=$RTV_SLURM_WORK/jobvenv     # the project, installed for the job user (no torch download)
SHIM_DIR=$RTV_SLURM_WORK/shim
MUNGE_PID=/run/munge/munged.pid      # Debian's munged keeps its pid file here
API_PID=$SKY_DIR/api-server.pid

export SLURM_CONF=$SLURM_DIR/slurm.conf

# The API server's environment: its own HOME and runtime dir, private port, no usage reports.
server_env() {
    # Called from a client too (the restart case): none of a client's settings may leak into the server.
    unset SKYPILOT_API_SERVER_ENDPOINT SKYPILOT_USER_ID SKYPILOT_DISABLE_LOCAL_API_SERVER
    export HOME=$SKY_DIR/home SKY_RUNTIME_DIR=$SKY_DIR/runtime
    export SKYPILOT_API_SERVER_LOCAL_PORT=$RTV_SLURM_API_PORT
    export SKYPILOT_DISABLE_USAGE_COLLECTION=1
    export PYTHONPATH=$RTV_REPO${PYTHONPATH:+:$PYTHONPATH}
}

# A client's environment, as a CI runner has it: another HOME and runtime dir (none of the
# server's files), its own SkyPilot user (SKYPILOT_USER_ID=IDENTITY), the server reached only
# through SKYPILOT_API_SERVER_ENDPOINT, and never a local server of its own.
# Usage: client_env IDENTITY (letters, digits, dashes)
client_env() {
    export HOME=$SKY_CLIENTS/$1/home SKY_RUNTIME_DIR=$SKY_CLIENTS/$1/runtime
    mkdir -p "$HOME" "$SKY_RUNTIME_DIR"
    unset SKYPILOT_API_SERVER_LOCAL_PORT
    export SKYPILOT_USER_ID=$1 SKYPILOT_API_SERVER_ENDPOINT=http://127.0.0.1:$RTV_SLURM_API_PORT
    export SKYPILOT_DISABLE_LOCAL_API_SERVER=1 SKYPILOT_DISABLE_USAGE_COLLECTION=1
    export PYTHONPATH=$RTV_REPO${PYTHONPATH:+:$PYTHONPATH}
}

log() { printf '%s local_slurm: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }
