#!/usr/bin/env bash
# Undo setup.sh: stop every daemon it started, by the pid it recorded (never
# by name), cancel what the job user left in Slurm, remove the job user and
# its files, remove $RTV_SLURM_WORK, then check nothing listens on our ports.
# Idempotent: safe on a clean machine, after a failed setup, or twice.
# The Debian packages stay installed (without any daemon running).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RTV_REPO=${RTV_REPO:-$(cd "$here/../.." && pwd)}
source "$here/common.sh"

[ "$(id -u)" = 0 ] || die "teardown.sh needs root (found uid $(id -u))"

descendants() {  # descendants PID: every process below PID
    ps -eo pid=,ppid= | awk -v root="$1" '
        { parent[$1] = $2 }
        END { for (p in parent) { q = p; while (q in parent && q != root && q > 1) q = parent[q]; if (q == root && p != root) print p } }'
}

stop_pid_file() {  # stop_pid_file NAME FILE: TERM the recorded pid, then KILL it and whatever it spawned
    local name=$1 file=$2 pid
    [ -s "$file" ] || return 0
    pid=$(tr -dc 0-9 <"$file")
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        local children; children=$(descendants "$pid" | tr '\n' ' ')
        log "stopping $name (pid $pid${children:+; children $children})"
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$pid" $children 2>/dev/null || true
    fi
    rm -f "$file"
}

close_ssh_masters() {
    # SkyPilot's ssh ControlMaster to the login node outlives the API server.
    # Ours are the ssh clients connected to our sshd's port; each is asked to
    # exit through its control socket (named in its title), else killed by pid.
    local pid sock
    for pid in $(ss -tnpH state established "( dport = :$RTV_SLURM_SSHD_PORT )" | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u); do
        sock=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | sed -n 's/^ssh: \(\S*\) \[mux\].*/\1/p')
        log "closing SkyPilot's ssh connection to the login node (pid $pid)"
        [ -n "$sock" ] && ssh -O exit -S "$sock" master >/dev/null 2>&1 || kill -TERM "$pid" 2>/dev/null || true
    done
    rmdir /tmp/sky_ssh_*/* /tmp/sky_ssh_* 2>/dev/null || true   # empty control-socket folders only
}

remove_job_user() {
    id -u "$RTV_SLURM_USER" >/dev/null 2>&1 || return 0
    local uid; uid=$(id -u "$RTV_SLURM_USER")
    if [ -s "$SLURM_DIR/slurmctld.pid" ] && [ -f "$SLURM_CONF" ]; then
        scancel -u "$RTV_SLURM_USER" 2>/dev/null || true
        for _ in $(seq 50); do [ -z "$(squeue -h -u "$RTV_SLURM_USER" 2>/dev/null)" ] && break; sleep 0.2; done
    fi
    local pids; pids=$(ps -o pid= -u "$uid" | tr '\n' ' ' || true)   # ps exits 1 when there are none
    [ -z "${pids// }" ] || { log "killing the job user's processes: $pids"; kill -KILL $pids 2>/dev/null || true; }
    find /tmp -xdev -maxdepth 1 -user "$uid" -exec rm -rf {} +   # uv cache, runtime dirs
    userdel -r "$RTV_SLURM_USER" 2>/dev/null || userdel "$RTV_SLURM_USER"
}

stop_pid_file "SkyPilot API server" "$API_PID"
close_ssh_masters
remove_job_user
stop_pid_file sshd "$SSHD_DIR/sshd.pid"
stop_pid_file slurmd "$SLURM_DIR/slurmd.pid"
stop_pid_file slurmctld "$SLURM_DIR/slurmctld.pid"
# munged's pid file is Debian's; stop it only when this stage started it.
if [ -f "$RTV_SLURM_WORK/munged.ours" ]; then stop_pid_file munged "$MUNGE_PID"; fi
rm -rf "$RTV_SLURM_WORK"

listening=$(ss -ltnH | awk '{print $4}' | grep -E ":($RTV_SLURM_CTLD_PORT|$RTV_SLURM_SLURMD_PORT|$RTV_SLURM_SSHD_PORT|$RTV_SLURM_API_PORT)\$" || true)
[ -z "$listening" ] || die "still listening after teardown: $listening"
log "teardown done: no daemon of ours running, nothing listening on our ports"
