"""``benchmarks/onednn_gemms.py``: once routed, ATen's large f32 GEMMs (``mm``, ``addmm``, forward
and backward) run on oneDNN and give torch's results to f32's accuracy; small ones, other
dtypes and a disabled routing keep ATen's kernels.  In a subprocess: the routing is for the
whole process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from edatalog.backend.kernels.arrays import onednn_linear_op

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import sys
sys.path.insert(0, "benchmarks")
import torch
import onednn_gemms
from torch.profiler import profile

def onednn_calls(fn):
    with profile() as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "mkldnn::_linear_pointwise")

torch.manual_seed(0)
x = torch.randn(64, 256, dtype=torch.float64)
w = torch.randn(256, 256, dtype=torch.float64)
b = torch.randn(256, dtype=torch.float64)
want = torch.nn.functional.linear(x, w, b)
routing = onednn_gemms.route()
xf, wf = x.float().requires_grad_(), w.float().requires_grad_()
got = []
assert onednn_calls(lambda: got.append(torch.nn.functional.linear(xf, wf, b.float()))) == 1
assert (got[0].double() - want).abs().max() <= 1e-4 * want.abs().max()
assert onednn_calls(lambda: got[0].sum().backward()) == 2  # both gradients are GEMMs of that size
assert (xf.grad.double() - torch.ones(64, 256, dtype=torch.float64) @ w).abs().max() <= 1e-3
assert onednn_calls(lambda: torch.mm(xf[:63].detach(), wf.detach())) == 0  # one row short
assert onednn_calls(lambda: torch.mm(x, w)) == 0  # f64
xd, wd = xf.detach(), wf.detach()
strided = torch.randn(512)[::2]  # oneDNN would read a bias as contiguous: ATen's addmm takes it
assert onednn_calls(lambda: torch.addmm(strided, xd, wd)) == 0
assert torch.allclose(torch.addmm(strided, xd, wd), xd @ wd + strided, rtol=1e-4, atol=1e-3)
window = torch.randn(512).as_strided((256, 256), (1, 1))  # rows that overlap: oneDNN refuses them
assert onednn_calls(lambda: torch.mm(xd, window)) == 0
routing.enabled = False
assert onednn_calls(lambda: torch.mm(xf.detach(), wf.detach())) == 0
assert torch.equal(torch.mm(xf.detach(), wf.detach()), torch.mm(xf.detach(), wf.detach()))
print("ok")
"""


@pytest.mark.skipif(onednn_linear_op() is None, reason="this torch has no oneDNN")
def test_routed_gemms_run_on_onednn_by_edatalogs_rule() -> None:
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout[-2000:] + done.stderr[-4000:]
