"""free_port: ports handed to child processes must not be ones the kernel hands out by itself."""
import socket

from ciuicflow.kvflow.sidecar import process
from ciuicflow.kvflow.sidecar.process import free_port


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    low = process._ephemeral_low()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    if low - 10000 >= 1000:                      # Linux default 32768-60999: there is room below it
        assert all(p < low for p in ports), [p for p in ports if p >= low]
    # A bind(0) meanwhile (a sidecar's data plane, an outgoing connection) cannot take one of them.
    taken = []
    try:
        for _ in range(50):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            taken.append(s)
        assert not {s.getsockname()[1] for s in taken} & set(ports)
    finally:
        for s in taken:
            s.close()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[-1]))           # still free: nothing in this process holds it
