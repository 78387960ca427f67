"""The ``etcd`` fixture: a real etcd on loopback (ciuicflow/testing/etcd.py) for the discovery tests, killed
after the test; they skip, saying why, when etcd is not installed."""
import signal

import pytest

from ciuicflow.testing.etcd import ETCD, Etcd


def require_etcd() -> str:
    if ETCD is None:
        pytest.skip("etcd is not installed (apt-get install -y etcd-server): discovery needs a real etcd")
    return ETCD


@pytest.fixture
def etcd(tmp_path):
    require_etcd()
    server = Etcd(tmp_path).start()
    yield server
    server.stop(signal.SIGKILL)
