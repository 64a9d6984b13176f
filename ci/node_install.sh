#!/usr/bin/env bash
# The reproducible install of a GPU node (the setup of every ci/*.sky.yaml that runs on GPUs):
#
#   ci/node_install.sh VENV                 a new venv at VENV: torch from RTV_TORCH_INDEX, then the `harness`
#                                           extra, every package at the version ci/node-requirements.lock pins
#   ci/node_install.sh VENV --write-lock    the same without the lock, then write the lock from what came
#
# Environment: RTV_TORCH (default torch==2.13.0), RTV_TORCH_INDEX (the wheel index of the declared CUDA build,
# e.g. https://download.pytorch.org/whl/cu128; a CPU index or a local one stands in where there is no GPU),
# RTV_CUDA (the CUDA version that build carries, e.g. 12.8; `none`: no GPU check, as `rtv gpu local` without CUDA).
#
# Nothing floats: torch comes alone (--no-deps) from its index; everything else (torch's own dependencies
# included: its CUDA runtime packages are pinned by torch's metadata) is resolved under the lock as
# constraints, then `pip check`. Before anything runs: python3 with venv (Debian: python3-venv), the torch
# build and, unless RTV_CUDA=none, torch.cuda.is_available() and the driver (nvidia-smi). A VENV that exists and
# was not made here (no stamp) is kept as it is (rtv gpu local points VENV at the venv rtv runs from); one made
# here with the same lock is reused, so a reused cluster installs nothing twice.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
lock=$here/node-requirements.lock
venv=${1:?usage: ci/node_install.sh VENV [--write-lock]}
mode=${2:-install}
torch_spec=${RTV_TORCH:-torch==2.13.0}
cuda=${RTV_CUDA:?RTV_CUDA: the CUDA version the torch build carries (e.g. 12.8), or none}

fail() { echo "node install: $1" >&2; echo "fix: $2" >&2; exit 1; }

command -v python3 >/dev/null || fail "no python3 on this node" "use an image with Python 3.10+ (apt-get install python3)"
python3 -c 'import ensurepip, venv' 2>/dev/null ||
    fail "python3 cannot make a venv (no ensurepip)" "apt-get install python3-venv (Debian/Ubuntu), or use an image with it"

stamp=$venv/.rtv-node-lock
if [ "$mode" = install ] && [ -e "$venv" ] && [ ! -e "$stamp" ]; then
    echo "node install: $venv exists and was not made here; kept as it is"
elif [ "$mode" = install ] && [ -e "$stamp" ] && cmp -s "$stamp" "$lock"; then
    echo "node install: $venv was made from this lock; reused"
else
    [ -n "${RTV_TORCH_INDEX:-}" ] || fail "RTV_TORCH_INDEX is not set" "declare the wheel index of the CUDA build in the task's envs"
    rm -rf "$venv"
    python3 -m venv "$venv"
    pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
    "${pip[@]}" --no-deps --index-url "$RTV_TORCH_INDEX" "$torch_spec"
    if [ "$mode" = --write-lock ]; then
        "${pip[@]}" -e "$repo[harness]"
        {
            echo "# Every package of a GPU node's venv but the project (ci/node_install.sh). Regenerate:"
            echo "#   RTV_CUDA=none RTV_TORCH_INDEX=https://download.pytorch.org/whl/cpu ci/node_install.sh rtv-out/lock-venv --write-lock"
            "$venv/bin/python" -m pip freeze --exclude-editable | grep -v -i -E '^reference[-_]trainer' |
                sed -E 's/^torch( @ .*|==.*)$/'"$torch_spec"'/I' | LC_ALL=C sort -f
        } >"$lock"
        echo "node install: wrote $lock"
    else
        "${pip[@]}" --constraint "$lock" -e "$repo[harness]"
    fi
    "$venv/bin/python" -m pip check
    cp "$lock" "$stamp"
fi

"$venv/bin/python" - "$cuda" <<'PY'
import subprocess, sys
import torch
cuda = sys.argv[1]
print(f"node install: torch {torch.__version__} (CUDA build {torch.version.cuda})")
if cuda != "none":
    if not (torch.version.cuda or "").startswith(cuda):
        sys.exit(f"node install: expected a torch built for CUDA {cuda}, found {torch.version.cuda}\n"
                 "fix: point RTV_TORCH_INDEX at that build's index, or declare RTV_CUDA to match")
    if not torch.cuda.is_available():
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True)
        sys.exit(f"node install: torch sees no GPU (nvidia-smi: {(smi.stdout + smi.stderr).strip()[:300]})\n"
                 "fix: a driver that supports CUDA " + cuda + " (check nvidia-smi), or an index of an older build")
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.split()
    print(f"node install: {torch.cuda.device_count()} GPUs, {torch.cuda.get_device_name(0)}, driver {driver[:1]}")
PY
