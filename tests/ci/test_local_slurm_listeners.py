"""The stage's listener check: any new non-loopback listener fails it, the baseline's do not."""

from __future__ import annotations

import os
import subprocess

import pytest

from ci.local_slurm.listeners import MARKER, foreign, is_loopback, is_ours, offenders, parse

# `ss -ltnuH` lines as ss 1.x prints them (netid, state, queues, local, peer).
BASELINE = """\
tcp   LISTEN 0      128          0.0.0.0:2024      0.0.0.0:*
"""
SAMPLES = """\
--- 1
tcp   LISTEN 0      128          0.0.0.0:2024      0.0.0.0:*
tcp   LISTEN 0      4096       127.0.0.1:46817     0.0.0.0:*
--- 2
tcp   LISTEN 0      4096       127.0.0.1:46817     0.0.0.0:*
tcp   LISTEN 0      128             [::]:22           [::]:*
udp   UNCONN 0      0      127.0.0.53%lo:53        0.0.0.0:*
tcp   LISTEN 0      128            [::1]:631          [::]:*
udp   UNCONN 0      0                  *:5353            *:*
tcp   LISTEN 0      128         10.1.2.3:8080      0.0.0.0:*
FOREIGN tcp   LISTEN 0      4096           *:33149         *:* users:(("pytest",pid=5333,fd=22))
"""


@pytest.mark.parametrize(
    ("local", "loopback"),
    [
        ("127.0.0.1:46817", True),
        ("127.8.9.10:1", True),
        ("127.0.0.53%lo:53", True),
        ("[::1]:631", True),
        ("[::ffff:127.0.0.1]:46590", True),  # grpc's IPv6 socket bound to 127.0.0.1
        ("[::ffff:10.0.0.1]:46590", False),
        ("0.0.0.0:2024", False),
        ("[::]:22", False),
        ("*:5353", False),
        ("10.1.2.3:8080", False),
        ("[fe80::1%eth0]:123", False),
        ("localhost:80", False),
    ],
)
def test_is_loopback(local: str, loopback: bool) -> None:
    assert is_loopback(local) is loopback


def test_parse_skips_separators_and_reads_the_local_column() -> None:
    assert parse(SAMPLES) >= {("tcp", "127.0.0.1:46817"), ("udp", "*:5353")}
    assert not any(local.startswith("---") for _, local in parse(SAMPLES))


def test_offenders_are_new_non_loopback_listeners_only() -> None:
    assert offenders(BASELINE, SAMPLES) == [("tcp", "10.1.2.3:8080"), ("tcp", "[::]:22"), ("udp", "*:5353")]


def test_a_baseline_listener_is_exempt_and_a_clean_stage_passes() -> None:
    assert offenders(BASELINE, BASELINE + "tcp LISTEN 0 1 127.0.0.1:9 0.0.0.0:*\n") == []
    assert offenders("", BASELINE) == [("tcp", "0.0.0.0:2024")]


def test_foreign_listeners_are_reported_apart_not_failed() -> None:
    assert foreign(SAMPLES) == [("tcp", "*:33149")]
    assert ("tcp", "*:33149") not in offenders(BASELINE, SAMPLES)


def test_is_ours_by_marker_or_job_user_and_a_vanished_process_counts() -> None:
    env = dict(os.environ, **{MARKER: "stage-42"})
    with subprocess.Popen(["sleep", "30"], env=env) as marked, subprocess.Popen(["sleep", "30"]) as unmarked:
        try:
            assert is_ours(marked.pid, "stage-42", job_uid=-1)
            assert not is_ours(marked.pid, "stage-7", job_uid=-1)
            assert not is_ours(unmarked.pid, "stage-42", job_uid=-1)
            assert is_ours(unmarked.pid, "stage-42", job_uid=os.getuid())
        finally:
            marked.kill()
            unmarked.kill()
    assert is_ours(marked.pid, "stage-42", job_uid=-1)  # reaped: unknown, so counted as the stage's


def test_an_unowned_sighting_of_a_socket_another_sample_names_as_foreign_is_foreign() -> None:
    """Seen once without an owner (gone before ss looked), then named as another user's test worker."""
    unowned = "tcp LISTEN 0 4096 *:45015 *:*\n"
    theirs = 'FOREIGN tcp LISTEN 0 4096 *:45015 *:* users:(("pytest",pid=31001,fd=22))\n'
    ours = 'tcp LISTEN 0 4096 *:45015 *:* users:(("python",pid=77,fd=3))\n'
    assert offenders("", f"--- 1\n{unowned}--- 2\n{theirs}") == []
    assert offenders("", f"--- 1\n{unowned}") == [("tcp", "*:45015")], "never named: it counts as the stage's"
    assert offenders("", f"--- 1\n{unowned}--- 2\n{theirs}--- 3\n{ours}") == [("tcp", "*:45015")]
