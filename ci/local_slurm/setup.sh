#!/usr/bin/env bash
# Set up a one-node Slurm cluster on 127.0.0.1 that SkyPilot can launch on.
#
# As root, on a Debian 12 machine: installs slurm-wlm, munge, openssh-server
# and rsync from Debian's packages, then starts, all bound to 127.0.0.1 and
# recorded by pid files under $RTV_SLURM_WORK (see common.sh):
#   munged; slurmctld and slurmd for one node (private slurm.conf, SLURM_CONF);
#   a private sshd on $RTV_SLURM_SSHD_PORT that admits only the job user
#   ($RTV_SLURM_USER; the Slurm "login node" SkyPilot reaches over ssh);
#   the SkyPilot API server, a service with its own HOME, SKY_RUNTIME_DIR and
#   port; clients (common.sh, client_env) reach it only through its endpoint.
# It also prepares the job user's shell (shims/, SLURM_CONF), a venv with the
# project installed for the job (JOB_VENV: torch is copied from $RTV_PYTHON's
# venv, never downloaded) and SkyPilot's Slurm config (~/.slurm/config).
# Idempotent: it first runs teardown.sh, so a previous run's leftovers go.
# Usage: RTV_REPO=<repo> [RTV_PYTHON=<python with skypilot>] setup.sh
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RTV_REPO=${RTV_REPO:-$(cd "$here/../.." && pwd)}
source "$here/common.sh"

[ "$(id -u)" = 0 ] || die "setup.sh needs root (found uid $(id -u))"
[ -x "$RTV_PYTHON" ] || die "no python at RTV_PYTHON=$RTV_PYTHON; run 'make install' or set RTV_PYTHON"
"$here/teardown.sh"

install_packages() {
    # A machine without policy-rc.d would start the packaged sshd on port 22
    # of every address; block service starts while installing.
    local guard= packages=(slurm-wlm munge openssh-server rsync)
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d
        guard=/usr/sbin/policy-rc.d
    fi
    if dpkg-query -W -f '${Status}\n' "${packages[@]}" 2>/dev/null | grep -cx 'install ok installed' | grep -qx "${#packages[@]}"; then
        log "Debian packages already installed: ${packages[*]}"
    else
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
    fi
    [ -z "$guard" ] || rm -f "$guard"
}

check_skypilot() {
    # The shims exist because of what SkyPilot's bootstrap downloads; stop if that changed.
    (server_env && cd "$RTV_REPO" && "$RTV_PYTHON" -m ci.local_slurm.sky_sdk check-bootstrap)
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local deadline=$((SECONDS + $1)) what=$2; shift 2
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $deadline ] || die "timed out waiting for $what"
        sleep 0.2
    done
}

start_munge() {
    [ -s /etc/munge/munge.key ] || die "/etc/munge/munge.key missing (the munge package's postinst makes it)"
    if munge -n >/dev/null 2>&1; then log "munged already running (not ours; left alone)"; return; fi
    install -d -o munge -g munge -m 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged
    touch "$RTV_SLURM_WORK/munged.ours"   # teardown.sh stops munged only when this marker exists
    wait_for 10 munged munge -n
}

write_slurm_conf() {
    local node mem
    node=$(hostname -s)
    getent hosts "$node" | grep -q '^127\.' || die "hostname $node does not resolve to 127.0.0.0/8 (add it to /etc/hosts)"
    mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)
    install -d -m 0755 "$SLURM_DIR" "$SLURM_DIR/state" "$SLURM_DIR/spool"
    # NoCtldInAddrAny + NoInAddrAny: both are needed for slurmctld and slurmd
    # to bind 127.0.0.1 rather than every address.
    cat >"$SLURM_CONF" <<CONF
ClusterName=$RTV_SLURM_CLUSTER
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$RTV_SLURM_CTLD_PORT
SlurmdPort=$RTV_SLURM_SLURMD_PORT
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$SLURM_DIR/state
SlurmdSpoolDir=$SLURM_DIR/spool
SlurmctldPidFile=$SLURM_DIR/slurmctld.pid
SlurmdPidFile=$SLURM_DIR/slurmd.pid
SlurmctldLogFile=$SLURM_DIR/slurmctld.log
SlurmdLogFile=$SLURM_DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=5
MinJobAge=30
NodeName=$node NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES DefaultTime=01:00:00 MaxTime=INFINITE State=UP
CONF
}

start_slurm() {
    write_slurm_conf
    /usr/sbin/slurmctld -f "$SLURM_CONF"
    /usr/sbin/slurmd -f "$SLURM_CONF"
    wait_for 30 "the Slurm node to be idle" sh -c 'sinfo -h -o %T | grep -qx idle'
}

make_job_user() {
    useradd -m -d "$JOB_HOME" -s /bin/bash "$RTV_SLURM_USER"
    usermod -p '*' "$RTV_SLURM_USER"   # no password, yet not locked (sshd refuses locked accounts)
    install -d -m 0755 "$SSHD_DIR"
    ssh-keygen -q -t ed25519 -N '' -f "$SSHD_DIR/host_ed25519"
    ssh-keygen -q -t ed25519 -N '' -f "$SSHD_DIR/client_key"
    install -d -o "$RTV_SLURM_USER" -m 0700 "$JOB_HOME/.ssh"
    install -o "$RTV_SLURM_USER" -m 0600 "$SSHD_DIR/client_key.pub" "$JOB_HOME/.ssh/authorized_keys"
    # SkyPilot runs its bootstrap in login shells: the shims come first on PATH from here.
    cat >"$JOB_HOME/.bash_profile" <<PROFILE
export PATH=$SHIM_DIR:\$PATH
[ -f ~/.bashrc ] && . ~/.bashrc
PROFILE
    chown "$RTV_SLURM_USER:" "$JOB_HOME/.bash_profile"
}

install_shims() {
    install -d -m 0755 "$SHIM_DIR"
    install -m 0755 "$here/shims/curl" "$here/shims/uv" "$SHIM_DIR/"
    "$RTV_PYTHON" -m pip install -q --disable-pip-version-check --target "$RTV_SLURM_WORK/uvpkg" uv
    chmod -R a+rX "$RTV_SLURM_WORK/uvpkg"
}

start_sshd() {
    install -d -m 0755 /run/sshd
    cat >"$SSHD_DIR/sshd_config" <<CONF
Port $RTV_SLURM_SSHD_PORT
ListenAddress 127.0.0.1
HostKey $SSHD_DIR/host_ed25519
PidFile $SSHD_DIR/sshd.pid
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin no
AllowUsers $RTV_SLURM_USER
UsePAM no
StrictModes no
MaxStartups 100:30:200
MaxSessions 100
# Every session, login shell or not (rsync's srun), finds our private slurm.conf.
SetEnv SLURM_CONF=$SLURM_CONF
CONF
    /usr/sbin/sshd -f "$SSHD_DIR/sshd_config" -E "$SSHD_DIR/sshd.log"
    wait_for 10 sshd ssh -i "$SSHD_DIR/client_key" -p "$RTV_SLURM_SSHD_PORT" -o BatchMode=yes \
        -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "$RTV_SLURM_USER@127.0.0.1" true
}

make_job_venv() {
    # The job runs a CPU canary from a venv of its own: the interpreter must be
    # one the job user can read (the project's may live under /root); the
    # packages are the project venv's (torch is never fetched): referenced by
    # a .pth file when the job user can read them, else hard-linked (or
    # copied); the project itself is installed from its tracked files.
    local version site src target
    version=$("$RTV_PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [ -x "/usr/bin/python$version" ] || die "the job venv needs /usr/bin/python$version (the project venv's version)"
    site=$("$RTV_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "/usr/bin/python$version" -m venv --without-pip "$JOB_VENV"
    target=$JOB_VENV/lib/python$version/site-packages
    if runuser -u "$RTV_SLURM_USER" -- test -r "$site/torch/__init__.py"; then
        echo "$site" >"$target/project-venv.pth"   # a path line only: that folder's own .pth files stay unread
    else
        cp -al "$site/." "$target/" 2>/dev/null || cp -a "$site/." "$target/"
        rm -rf "$target"/__editable__* "$target"/reference_trainer-*.dist-info
    fi
    src=$RTV_SLURM_WORK/src
    mkdir -p "$src"
    git -C "$RTV_REPO" ls-files -z -co --exclude-standard | (cd "$RTV_REPO" && tar --null -T - -cf -) | tar -xf - -C "$src"
    "$RTV_PYTHON" -m pip --python "$JOB_VENV/bin/python" install -q --disable-pip-version-check \
        --no-deps --no-index --no-build-isolation "$src"
    # PYTHONPATH of the caller (the checkout) must not stand in for the installed project.
    (cd / && env -u PYTHONPATH runuser -u "$RTV_SLURM_USER" -- "$JOB_VENV/bin/python" -c '
import canaries.cli, reference_trainer, torch
assert reference_trainer.__file__.startswith("'"$JOB_VENV"'"), reference_trainer.__file__') \
        || die "the job user cannot import the project from $JOB_VENV"
}

write_sky_config() {
    install -d -m 0700 "$SKY_DIR" "$SKY_DIR/home" "$SKY_DIR/home/.slurm" "$SKY_DIR/runtime"
    cat >"$SKY_DIR/home/.slurm/config" <<CONF
Host $RTV_SLURM_CLUSTER
  HostName 127.0.0.1
  Port $RTV_SLURM_SSHD_PORT
  User $RTV_SLURM_USER
  IdentityFile $SSHD_DIR/client_key
  IdentitiesOnly yes
CONF
}

start_api_server() {
    (server_env && cd "$RTV_REPO" && "$RTV_PYTHON" -m ci.local_slurm.sky_sdk start-server --pid-file "$API_PID")
}

t0=$SECONDS
install -d -m 0755 "$RTV_SLURM_WORK"
log "installing Debian packages"; install_packages
check_skypilot
log "starting munged, slurmctld, slurmd"; start_munge; start_slurm
log "job user $RTV_SLURM_USER, sshd on 127.0.0.1:$RTV_SLURM_SSHD_PORT"; make_job_user; install_shims; start_sshd
log "job venv $JOB_VENV"; make_job_venv
log "SkyPilot API server on 127.0.0.1:$RTV_SLURM_API_PORT"; write_sky_config; start_api_server
log "setup done in $((SECONDS - t0)) s"
