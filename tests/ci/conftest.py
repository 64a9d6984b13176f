"""A private SkyPilot for the CI tests: its own HOME, runtime dir, port and a seeded catalog; no server, no network.

SkyPilot reads ``$HOME`` and ``$SKY_RUNTIME_DIR`` when ``sky`` is imported
(some paths are fixed at import), so the first ``import sky`` of a test
process happens inside :func:`sky_sandbox`, with:

- ``HOME`` and ``SKY_RUNTIME_DIR``: one temporary folder per test session;
- ``SKYPILOT_API_SERVER_LOCAL_PORT``: a free port picked here, never the default;
- ``SKYPILOT_DISABLE_LOCAL_API_SERVER=1``: SkyPilot refuses to start a local
  API server (a test that would start one fails instead), and
  ``SKYPILOT_DISABLE_USAGE_COLLECTION=1``;
- ``HTTP(S)_PROXY`` pointing at a closed port: a catalog download fails
  instead of reaching the network.

The seeded catalog (``<runtime>/.sky/catalogs/v8/``, where
``sky.catalog.common.read_catalog`` looks) holds the two common files
``Task.validate`` reads and a Lambda ``vms.csv`` with two H200 instance
types and their prices (:data:`H200_TYPES`, the tests' cost oracle).
``import sky`` takes about 3 s, so it happens once per test process.

Without the ``ci`` extra (``pip install -e '.[test,harness]'``), every test
that requests ``sky_sandbox`` (directly or through another fixture) is skipped
at collection with :data:`SKY_MISSING`; the other tests here still run.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path

import pytest

H200_TYPES = {"gpu_2x_h200": (2, 7.5), "gpu_8x_h200": (8, 30.0)}  # (H200s, USD per hour): the seeded catalog
_CATALOG = {
    "common/accelerators.csv": "AcceleratorName,Clouds\nH200,\"['Lambda']\"\n",
    "common/metadata.csv": "GPU,MemoryGB,Manufacturer\nH200,141,NVIDIA\n",
    "lambda/vms.csv": "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Price,SpotPrice,Region,GpuInfo\n"
    + "".join(f"{name},H200,{count},52,450,{price},,us-east-1,\n" for name, (count, price) in H200_TYPES.items()),
}
_OWNED = {"imported_here": False}
SKY_MISSING = "needs the ci extra (pip install -e '.[ci]'): skypilot not installed"


def skypilot_installed() -> bool:
    """Whether ``import sky`` would find SkyPilot; looks, never imports (the first import belongs to ``sky_sandbox``)."""
    return importlib.util.find_spec("sky") is not None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that imports SkyPilot (``sky_sandbox``) skips without the ``ci`` extra, and is ``slow`` with it: the
    import alone is about 3 s of CPU a worker, and the GPU-CI tooling these tests check is not the trainer's or the
    harness's. CI runs them (its slow tier); ``make test`` keeps the tests of the CI code that need no SkyPilot."""
    installed = skypilot_installed()
    mark = pytest.mark.slow if installed else pytest.mark.skip(reason=SKY_MISSING)
    for item in items:
        if "sky_sandbox" in getattr(item, "fixturenames", ()):
            item.add_marker(mark)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def sky_home(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The session's private SkyPilot environment (see the module docstring), catalog seeded."""
    root = tmp_path_factory.mktemp("sky")
    home, runtime = root / "home", root / "runtime"
    catalogs = runtime / ".sky" / "catalogs" / "v8"
    for name, text in _CATALOG.items():
        (catalogs / name).parent.mkdir(parents=True, exist_ok=True)
        (catalogs / name).write_text(text)
    home.mkdir()
    dead = f"http://127.0.0.1:{_free_port()}"
    return {
        "HOME": str(home),
        "SKY_RUNTIME_DIR": str(runtime),
        "SKYPILOT_API_SERVER_LOCAL_PORT": str(_free_port()),
        "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
        "SKYPILOT_DISABLE_LOCAL_API_SERVER": "1",
        "HTTP_PROXY": dead,
        "HTTPS_PROXY": dead,
        "http_proxy": dead,
        "https_proxy": dead,
        "NO_PROXY": "",
        "no_proxy": "",
    }


@pytest.fixture
def sky_sandbox(sky_home: dict[str, str], monkeypatch: pytest.MonkeyPatch):
    """The ``sky`` module, imported (first time) and used inside the private environment."""
    if "sky" in sys.modules and not _OWNED["imported_here"]:
        pytest.fail("sky was imported outside the sandbox (with the real HOME); import it via sky_sandbox only")
    for name, value in sky_home.items():
        monkeypatch.setenv(name, value)
    import sky

    _OWNED["imported_here"] = True
    return sky


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


@pytest.fixture
def sky_fake(sky_sandbox):
    """The fake SkyPilot module (``fake_sky``), imported inside the sandbox."""
    from . import fake_sky

    return fake_sky


@pytest.fixture
def gate(sky_fake, repo_root: Path):
    """The 2xH200 gate task, checked (``ci.tasks.load_task``)."""
    from ci.tasks import load_task

    return load_task(repo_root / "ci" / "gate.sky.yaml")
