"""``ci.outputs.rsync_outputs`` with real rsync; only ssh is a stand-in (it runs the remote side here, in a login home).

The stand-in ssh drops its options and the host, like ssh hands the rest to
the login shell, and runs it in ``login/``: the Slurm layout SkyPilot makes
(the cluster's home under ``login/.sky_clusters/<name on cloud>``, entered by
``~/.sky_ssh_rc`` when ``SKY_CLUSTER_NAME`` names it).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync")

SSH_STUB = """#!/bin/sh
while [ $# -gt 0 ]; do case $1 in -F|-o|-i|-p|-l) shift 2;; -*) shift;; *) break;; esac; done
shift
cd "$FAKE_LOGIN" && HOME=$FAKE_LOGIN exec sh -c "$*"
"""
SESSION_RC = """if [ -n "$SKY_CLUSTER_NAME" ] && [ -d ~/.sky_clusters/$SKY_CLUSTER_NAME ]; then
    cd ~/.sky_clusters/$SKY_CLUSTER_NAME && export HOME=$(pwd)
fi
"""


def _layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: str) -> Path:
    home, login, bin_dir = tmp_path / "home", tmp_path / "login", tmp_path / "bin"
    (home / ".sky/generated/ssh").mkdir(parents=True)
    (home / ".sky/generated/ssh/c1").write_text(config)
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(SSH_STUB)
    (bin_dir / "ssh").chmod(0o755)
    login.mkdir()
    (login / ".sky_ssh_rc").write_text(SESSION_RC)
    for where, text in ((login, "login home"), (login / ".sky_clusters/c1-abcd", "cluster home")):
        (where / "sky_workdir/rtv-out/ci").mkdir(parents=True)
        (where / "sky_workdir/rtv-out/ci/where.txt").write_text(text)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("FAKE_LOGIN", str(login))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return tmp_path / "fetched"


@pytest.mark.parametrize(("config", "expected"), [
    ("Host c1\n  HostName 127.0.0.1\n  SetEnv SKY_CLUSTER_NAME=c1-abcd\n", "cluster home"),  # Slurm
    ("Host c1\n  HostName 127.0.0.1\n", "login home"),  # a VM: the workdir is in the ssh user's home
])
def test_evidence_comes_from_the_clusters_home(tmp_path, monkeypatch, config, expected):
    from ci.outputs import rsync_outputs

    local = _layout(tmp_path, monkeypatch, config)
    assert rsync_outputs("c1", "rtv-out/ci", local, timeout=30) == local
    assert (local / "where.txt").read_text() == expected


def test_a_cluster_without_an_ssh_config_is_a_clear_error(tmp_path, monkeypatch):
    from ci.outputs import rsync_outputs

    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no ssh config for cluster c9"):
        rsync_outputs("c9", "rtv-out/ci", tmp_path / "x", timeout=5)
