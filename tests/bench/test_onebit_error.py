"""bench/onebit/error.py: the share of a gradient the 1-bit codec drops, and a smoke run."""
import json
import subprocess
import sys

import pytest
import torch

from tests import REPO

ROOT = str(REPO)
from bench.onebit import error as onebit_error


def _closed_form(x, chunk):
    """Scale x sign with scale = mean |x| over a chunk's n elements (the last one may be short)
    keeps l1^2 / n of the chunk's energy."""
    kept = sum(float(c.abs().sum().square() / c.numel()) for c in x.double().split(chunk))
    return 1 - kept / float(x.double().square().sum())


@pytest.mark.parametrize("numel,chunk", [(1000, 256), (4099, 64), (256, 256)])
def test_dropped_share_is_the_codecs_lost_energy(numel, chunk):
    torch.manual_seed(numel)
    x = torch.randn(numel) * torch.rand(numel).pow(3)  # heavy-tailed, as gradients are
    assert onebit_error.dropped_share(x, chunk) == pytest.approx(_closed_form(x, chunk), abs=1e-5)


def test_dropped_share_extremes():
    signs = torch.randint(0, 2, (512,)).float() * 2 - 1
    assert onebit_error.dropped_share(3 * signs, 256) == pytest.approx(0.0, abs=1e-6)
    one_hot = torch.zeros(256)
    one_hot[17] = 5.0  # one element holds everything: the sign spreads it over 256
    assert onebit_error.dropped_share(one_hot, 256) == pytest.approx(1 - 1 / 256, abs=1e-6)
    assert onebit_error.dropped_share(torch.zeros(300), 256) == 0.0
    x = torch.zeros(1000)
    x[:10] = torch.arange(1, 11).float()
    assert onebit_error.top_energy(x, 0.01) == pytest.approx(1.0)  # 10 elements are its 1%
    assert onebit_error.top_energy(torch.ones(1000), 0.01) == pytest.approx(0.01)


def test_smoke_run_and_bad_input(tmp_path):
    out = tmp_path / "e.json"
    proc = subprocess.run([sys.executable, "-m", "bench.onebit.error",
                           "--task", "mlp_sgd_constant", "--smoke", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    records = result["records"]
    assert {r["step"] for r in records} == {0, 2}
    assert {r["layer"] for r in records} == {"(all)", "0.weight", "2.weight", "4.weight"}
    for r in records:
        assert 0.0 < r["dropped"] < 1.0 and 0.0 < r["top1_energy"] <= 1.0, r
    assert "| mlp_sgd_constant | 2 | 2.weight | 262144 |" in proc.stdout
    adam = subprocess.run([sys.executable, "-m", "bench.onebit.error",
                           "--task", "charlm_adamw", "--smoke", "--json", str(tmp_path / "a.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert adam.returncode != 0 and "SGD tasks only" in adam.stderr
    late = subprocess.run([sys.executable, "-m", "bench.onebit.error",
                           "--task", "mlp_sgd_constant", "--at", "5000",
                           "--json", str(tmp_path / "b.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert late.returncode != 0 and "--at steps must lie in" in late.stderr
