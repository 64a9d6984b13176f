"""``rtv gpu ...`` wired to the launcher: the fake SkyPilot stands in for the ``sky`` module the commands import."""

from __future__ import annotations

import sys

import pytest

from canaries.cli import main


@pytest.fixture
def fake(sky_sandbox, monkeypatch: pytest.MonkeyPatch):
    from .fake_sky import FakeSky

    fake = FakeSky()
    monkeypatch.setitem(sys.modules, "sky", fake)  # what `import sky` inside the commands returns
    yield fake
    fake.release()


def test_down_alone_proves_absence_and_receipts_list_it(fake, sky_sandbox, tmp_path, capsys):
    fake.launch(sky_sandbox.Task(run="true"), cluster_name="rtv-gate-5-1")
    fake.server.run_pending()
    assert main(["gpu", "status"]) == 0
    assert "rtv-gate-5-1" in capsys.readouterr().out
    assert main(["gpu", "down", "rtv-gate-5-1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "teardown: cluster rtv-gate-5-1 absent (confirmed)" in out and "rtv-gate-5-1" not in fake.clusters
    assert main(["gpu", "receipts", "--in", str(tmp_path)]) == 0
    assert "rtv-gate-5-1" in capsys.readouterr().out
    (receipt,) = tmp_path.glob("gpu-receipt-*.json")
    receipt.write_text(receipt.read_text().replace("confirmed", "CONFIRMED"))
    assert main(["gpu", "receipts", "--in", str(tmp_path)]) == 1


def test_down_that_cannot_prove_absence_exits_6(fake, sky_sandbox, tmp_path, monkeypatch):
    import functools

    import ci.launcher

    # Every attempt fails: without this the command sleeps its real backoffs (5 + 10 + 20 s) between them.
    monkeypatch.setattr(ci.launcher, "Timeouts", functools.partial(ci.launcher.Timeouts, down_backoff=0.0))
    fake.launch(sky_sandbox.Task(run="true"), cluster_name="rtv-gate-5-2")
    fake.server.run_pending()
    fake.inject("down", "error", always=True)
    assert main(["gpu", "down", "rtv-gate-5-2", "--wait", "0", "--out", str(tmp_path)]) == 6
    assert fake.calls.count("down") == ci.launcher.Timeouts().down_attempts, "every attempt was made"


def test_launch_refuses_a_malformed_task_with_exit_2(sky_sandbox, tmp_path, capsys):
    task = tmp_path / "bad.sky.yaml"
    task.write_text("name: bad\nresources:\n  accelerators: H200:2\nrun: echo hi\n")
    assert main(["gpu", "launch", str(task), "--run-id", "1", "--attempt", "1", "--out", str(tmp_path)]) == 2
    assert "autostop" in capsys.readouterr().err


def test_cluster_names_are_deterministic_and_valid(sky_sandbox):
    from sky.utils.common_utils import check_cluster_name_is_valid

    from ci.launcher import cluster_name

    name = cluster_name("rtv-gate", "123456789", 3)
    assert name == cluster_name("rtv-gate", "123456789", 3) == "rtv-gate-123456789-3"
    assert cluster_name("Canaries_8x", "7", 1) == "rtv-canaries-8x-7-1"
    check_cluster_name_is_valid(name)
    with pytest.raises(ValueError):
        cluster_name("rtv-gate", "12;rm", 1)


@pytest.mark.parametrize("error", ["NoCloudAccessError", "CloudUserIdentityError"])
def test_launch_without_cloud_credentials_exits_2_with_the_fix(sky_sandbox, tmp_path, capsys, monkeypatch, error):
    from ci import cli

    from .fake_sky import FakeSky

    fake = FakeSky()

    def refuse(*args, **kwargs):  # what SkyPilot raises when `sky check` finds no usable cloud
        raise getattr(sky_sandbox.exceptions, error)("Cloud access is not set up. Run: `sky check`")

    monkeypatch.setattr(fake, "launch", refuse)
    monkeypatch.setattr(cli, "_sky", lambda: fake)  # the task file is still parsed by the real SkyPilot
    argv = ["gpu", "launch", "ci/gate.sky.yaml", "--run-id", "1", "--attempt", "1", "--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "SkyPilot cannot use a cloud: Cloud access is not set up" in err
    assert "fix: set up credentials" in err and "sky check" in err
    assert list(tmp_path.glob("gpu-receipt-*.json")), "the receipt is still written"


@pytest.mark.parametrize("env", ["NOEQUALS", "=1", "1X=2", "A B=1"])
def test_launch_refuses_a_malformed_env_with_exit_2(fake, sky_sandbox, repo_root, tmp_path, capsys, env):
    argv = [
        "gpu",
        "launch",
        str(repo_root / "ci" / "gate.sky.yaml"),
        "--cluster",
        "rtv-env-1",
        "--env",
        "RTV_TIME_LIMIT=1m",
        "--env",
        env,
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 2
    assert f"found {env!r}" in capsys.readouterr().err and not fake.clusters  # nothing was launched


def test_sweep_downs_every_ci_cluster_of_any_user_with_a_receipt_each(fake, sky_sandbox, tmp_path, capsys):
    for user, name in (("runnera", "rtv-gate-6-1"), ("runnerb", "rtv-gate-6-2"), ("runnerb", "mine")):
        fake.as_user(user).launch(sky_sandbox.Task(run="true"), cluster_name=name)
    fake.server.run_pending()
    assert main(["gpu", "sweep", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 cluster(s) named rtv-* older than 0s" in out and sorted(fake.clusters) == ["mine"]
    assert len(list(tmp_path.glob("gpu-receipt-*.json"))) == 2
    assert main(["gpu", "sweep", "--older-than", "soon", "--out", str(tmp_path)]) == 2
    assert "--older-than" in capsys.readouterr().err


def test_the_scheduled_sweeper_fails_loudly_when_it_found_a_cluster(fake, sky_sandbox, tmp_path, capsys):
    assert main(["gpu", "sweep", "--fail-if-found", "--out", str(tmp_path)]) == 0, "nothing left over: it passes"
    fake.as_user("runnera").launch(sky_sandbox.Task(run="true"), cluster_name="rtv-gate-7-1")
    fake.server.run_pending()
    assert main(["gpu", "sweep", "--fail-if-found", "--out", str(tmp_path)]) == 1
    assert "FAILED: 1 cluster(s) outlived their runs" in capsys.readouterr().out and not fake.clusters
