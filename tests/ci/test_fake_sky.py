"""The fake SkyPilot follows the installed SDK: same functions, compatible signatures, SkyPilot's own types.

And the sandbox keeps its promise: no SkyPilot API server can start in a test.
"""

from __future__ import annotations

import inspect
import socket

import pytest


@pytest.fixture
def sky_fake(sky_sandbox):
    from . import fake_sky

    return fake_sky


def compatible(fake, real) -> list[str]:
    """Why ``fake`` cannot stand in for ``real`` (empty when it can).

    Every parameter of the fake exists in the real function with the same
    kind and default; every parameter the real one requires, the fake has.
    """
    fake_params = dict(inspect.signature(fake).parameters)
    real_params = inspect.signature(real).parameters
    problems = []
    for name, param in fake_params.items():
        if name not in real_params:
            problems.append(f"{name}: not a parameter of the real function")
            continue
        other = real_params[name]
        if param.kind != other.kind:
            problems.append(f"{name}: kind {param.kind} vs real {other.kind}")
        if param.default != other.default:
            problems.append(f"{name}: default {param.default!r} vs real {other.default!r}")
    for name, other in real_params.items():
        required = other.default is inspect.Parameter.empty and other.kind not in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        )
        if required and name not in fake_params:
            problems.append(f"{name}: required by the real function, missing in the fake")
    return problems


def test_every_replaced_sdk_function_exists_with_a_compatible_signature(sky_sandbox, sky_fake):
    fake = sky_fake.FakeSky()
    for name in sky_fake.REPLACES:
        assert hasattr(sky_sandbox, name), f"sky.{name} does not exist in the installed SkyPilot"
        assert compatible(getattr(fake, name), getattr(sky_sandbox, name)) == [], name


def test_the_compatibility_check_can_fail(sky_sandbox):
    def renamed(task, cluster="x"):  # real: cluster_name
        return None

    def missing_required(cluster_name):  # real launch requires task
        return None

    assert compatible(renamed, sky_sandbox.launch)
    assert compatible(missing_required, sky_sandbox.launch)


def test_statuses_are_skypilots_own_types(sky_sandbox, sky_fake):
    from sky.schemas.api.responses import StatusResponse
    from sky.server.common import RequestId

    fake = sky_fake.FakeSky()
    assert fake.JobStatus is sky_sandbox.JobStatus and fake.ClusterStatus is sky_sandbox.ClusterStatus
    assert fake.StatusRefreshMode is sky_sandbox.StatusRefreshMode and fake.exceptions is sky_sandbox.exceptions
    request = fake.launch(sky_sandbox.Task(run="true"), cluster_name="c")
    assert isinstance(request, RequestId)
    job_id, handle = fake.get(request)
    statuses = fake.get(fake.job_status("c", [job_id]))
    assert all(isinstance(s, sky_sandbox.JobStatus) for s in statuses.values())
    (record,) = fake.get(fake.status(["c"]))
    assert isinstance(record, StatusResponse) and isinstance(record.status, sky_sandbox.ClusterStatus)
    assert isinstance(handle.launched_resources, sky_sandbox.Resources)
    fake.get(fake.down("c"))
    with pytest.raises(sky_sandbox.exceptions.ClusterDoesNotExist):
        fake.get(fake.down("c"))


def test_the_sandbox_cannot_start_an_api_server(sky_sandbox, sky_home):
    port = int(sky_home["SKYPILOT_API_SERVER_LOCAL_PORT"])
    assert port != 46580  # SkyPilot's default port
    with pytest.raises(Exception, match=r"disabled|SKYPILOT_DISABLE_LOCAL_API_SERVER"):
        sky_sandbox.status()
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "something listens on the sandbox's API port"
