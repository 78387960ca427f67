"""Fixtures that run real KV-flow sidecar processes on 127.0.0.1 and always clean them up
(the classes behind them: sidecars.py)."""
import os
import subprocess

import pytest

from tests.kvflow.sidecars import SidecarFactory, Unprivileged


@pytest.fixture
def sidecars(tmp_path, request):
    factory = SidecarFactory(tmp_path)
    yield factory
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    factory.cleanup(dump=failed)


@pytest.fixture(scope="module")
def module_sidecars(tmp_path_factory):
    factory = SidecarFactory(tmp_path_factory.mktemp("sidecars"))
    yield factory
    factory.cleanup()


ATTACKER = "kvflow-attacker"


@pytest.fixture(scope="session")
def unprivileged():
    """The local user ``kvflow-attacker`` (created if missing); skips unless the tests run as root."""
    import shutil
    if os.geteuid() != 0 or not shutil.which("runuser") or not shutil.which("useradd"):
        pytest.skip("needs root, runuser and useradd to run a client as another local user")
    if subprocess.run(["id", "-u", ATTACKER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", ATTACKER],
                       check=True, capture_output=True)
    return Unprivileged(ATTACKER)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
