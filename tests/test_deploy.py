"""deploy/kubernetes: every manifest valid against the Kubernetes schemas (the ``kubernetes-validate``
package, strict: unknown fields refused), and what the schemas cannot see: each sidecar is a native sidecar
probed on its gRPC health service, its flags are flags the sidecar accepts, and its memory limit covers its
memory cap as the soak measures it (1.5 x --max-total-bytes + idle RSS + 48 MiB, docs/kvflow.md)."""
import pathlib
import re
import subprocess
import sys
import time

import pytest

from tests import REPO

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate "
                                          "(in the test extra)")
yaml = pytest.importorskip("yaml")

MANIFESTS = sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())    # 1.29: native sidecars on by default
SLACK = 48 << 20


def _documents():
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path, doc


def _pods():
    for path, doc in _documents():
        if doc["kind"] in ("StatefulSet", "Deployment"):
            yield path, doc, doc["spec"]["template"]["spec"]


def _mebibytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", quantity).groups()
    return int(number) << (20 if unit == "Mi" else 30)


@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_are_valid_kubernetes(version):
    assert MANIFESTS
    for path, doc in _documents():
        kubernetes_validate.validate(doc, version, strict=True)


def _sidecars():
    for path, doc, pod in _pods():
        for c in pod.get("initContainers", []):
            if c["name"] == "kvflow-sidecar":
                yield path, pod, c


def _config(container, tmp_path):
    """The sidecar's settings from its command line, as it would parse them in the pod (environment values
    and the Secret's files filled in)."""
    from ciuicflow.kvflow.sidecar.config import load_config
    secret = next(doc for _, doc in _documents() if doc["kind"] == "Secret")
    for name, text in secret["stringData"].items():
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o600)
    argv = [a.replace("$(POD_NAME)", "decode-0").replace("$(POD_IP)", "10.1.2.3")
             .replace("/etc/ciuicflow", str(tmp_path)) for a in container["command"][1:]]
    return load_config(argv)


def _idle_rss(tmp_path) -> int:
    """A sidecar's resident memory once started and idle (measured here: no figure to go stale)."""
    from ciuicflow.kvflow.sidecar.process import free_port
    log = open(tmp_path / "idle.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "ciuicflow.kvflow.server", "--name", "idle", "--api",
                             f"127.0.0.1:{free_port()}", "--listen", f"127.0.0.1:{free_port()}"], cwd=str(REPO),
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while b"ready" not in (tmp_path / "idle.log").read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "idle.log").read_text()
            time.sleep(0.1)
        time.sleep(1.0)
        status = pathlib.Path(f"/proc/{proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) << 10
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


def test_sidecars_are_native_probed_and_sized(tmp_path):
    sidecars = list(_sidecars())
    assert {p.name for p, _, _ in sidecars} == {"30-decode.yaml", "31-prefill.yaml"}
    idle = _idle_rss(tmp_path)
    for path, pod, c in sidecars:
        assert c["restartPolicy"] == "Always", path           # a native sidecar container
        cfg = _config(c, tmp_path)
        assert cfg.discovery and cfg.peer_secrets and cfg.advertise == "10.1.2.3:50152", path
        port = int(cfg.listen.rpartition(":")[2])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == port, (path, probe)
        limits, requests = c["resources"]["limits"], c["resources"]["requests"]
        need = int(1.5 * cfg.max_total_bytes) + idle + SLACK
        assert _mebibytes(limits["memory"]) >= need, (path, limits["memory"], need >> 20)
        assert requests["memory"] == limits["memory"], path     # no eviction below the cap it was given
        vllm = next(x for x in pod["containers"] if x["name"] == "vllm")
        shared = {m["name"] for m in vllm["volumeMounts"]} & {m["name"] for m in c["volumeMounts"]}
        assert {"credentials", "shm"} <= shared, path
        assert any(e["name"] == "CIUICFLOW_KVFLOW_API_TOKEN_FILE" for e in vllm["env"]), path
    print(f"\nidle sidecar RSS {idle >> 20} MiB")
