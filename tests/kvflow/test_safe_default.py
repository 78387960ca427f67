"""Safe by default: a sidecar whose peer port is reachable from the network refuses to start without a peer
credential unless --insecure says so (and then warns loudly, and says so in Stats and its metrics); a
loopback-only sidecar starts without one, with a warning."""
import os
import subprocess
import sys
import urllib.request

from tests import REPO


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("CIUICFLOW_KVFLOW_")}
    env["PYTHONPATH"] = str(REPO)
    return env


def _refused(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ciuicflow.kvflow.server", "--name", "x", "--api", "127.0.0.1:0",
                           *args], cwd=str(REPO), env=_env(), capture_output=True, text=True, timeout=60)


def test_network_listen_without_credentials_refuses_to_start(tmp_path):
    for args in ([], ["--listen", "0.0.0.0:0"], ["--listen", "[::]:0"], ["--listen", "0.0.0.0:0", "--tls-cert",
                 "c.pem", "--tls-key", "k.pem"]):      # TLS without --tls-ca authenticates no peer
        done = _refused(*args)
        assert done.returncode != 0, (args, done.stderr)
        err = done.stderr
        assert "no peer credential" in err and "--token-file" in err and "--peer-secrets-file" in err
        assert "--tls-ca" in err and "--insecure" in err and "127.0.0.1" in err and "Traceback" not in err
    config = tmp_path / "sidecar.toml"
    config.write_text('listen = "0.0.0.0:0"\n')
    assert _refused("--config", str(config)).returncode != 0


def _network(sc, *args):
    sc.args += ["--listen", f"0.0.0.0:{sc.listen_port}", *args]     # peers still reach it on 127.0.0.1
    return sc


def test_network_listen_with_a_token_starts(sidecars, tmp_path):
    token = tmp_path / "token"
    token.write_text("a-shared-secret\n")
    token.chmod(0o600)
    a, b = sidecars.make("a", args=["--token-file", str(token)]), sidecars.make("b")
    _network(b, "--token-file", str(token))
    a.peers, b.peers = {"b": b.listen}, {"a": a.listen}
    sidecars.start_all(a, b)
    a.client().send("b", "k", b"over a token").wait(30)
    assert b.client().recv("k", timeout_s=10) == b"over a token"
    assert b.stats()["insecure"] is False and "INSECURE" not in b.log()
    env_token = _network(sidecars.make("c", env={"CIUICFLOW_KVFLOW_TOKEN": "from-the-environment"}))
    sidecars.start_all(env_token)


def test_insecure_starts_and_warns(sidecars, tmp_path):
    metrics = sidecars.free_port()
    b = _network(sidecars.make("b"), "--insecure", "--metrics-port", str(metrics))
    sidecars.start_all(b)
    assert "WARNING" in b.log() and "INSECURE (--insecure): peers are NOT authenticated" in b.log()
    assert b.stats()["insecure"] is True
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()
    assert "ciuicflow_kvflow_insecure 1.0" in text
    loopback = sidecars.make("l")        # the fixture's default: 127.0.0.1, no credential
    sidecars.start_all(loopback)
    assert "WARNING" in loopback.log() and "no peer credential" in loopback.log()
    assert loopback.stats()["insecure"] is False
