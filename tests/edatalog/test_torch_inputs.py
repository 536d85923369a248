"""PyTorch tensors as input values: every dtype the language has, on any device, with or without
``requires_grad``, converted exactly (bf16 bit for bit) and cast like numpy arrays."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

import edatalog
from edatalog.errors import EdlError
from edatalog.ir import dtypes

TORCH = {
    "f64": torch.float64,
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "i64": torch.int64,
    "i32": torch.int32,
    "bool": torch.bool,
}


def _identity(dtype: str) -> edatalog.Program:
    return edatalog.compile_string(f"dim N = 6.\ninput x[N] : {dtype}.\noutput x.\n")


def _values(dtype: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if dtype == "bool":
        return torch.rand(6, generator=gen) < 0.5
    if dtype in ("i64", "i32"):
        return torch.randint(-1000, 1000, (6,), generator=gen, dtype=TORCH[dtype])
    return (torch.randn(6, generator=gen, dtype=torch.float64) * 1000).to(TORCH[dtype])


def test_the_table_covers_every_dtype() -> None:
    assert set(TORCH) == set(dtypes.DTYPES)


@pytest.mark.parametrize("dtype", dtypes.DTYPES)
def test_every_dtype_converts_exactly(dtype: str) -> None:
    t = _values(dtype)
    got = _identity(dtype).prepare({"x": t})["x"]
    assert got.dtype == dtypes.to_numpy(dtype) and got.shape == (6,)
    if dtype == "bf16":  # the same 16 bits, not a round trip through another type
        assert got.view(np.int16).tolist() == t.view(torch.int16).tolist()
    else:
        assert got.tolist() == t.tolist()


def test_a_bf16_program_runs_on_bf16_tensors() -> None:
    prog = edatalog.compile_string("input x[1000] : bf16.\ns[] += x[i].")
    s = prog.run({"x": torch.ones(1000, dtype=torch.bfloat16)})["s"]
    assert s.dtype == np.dtype(ml_dtypes.bfloat16) and float(s) == 1000.0


def test_gradients_and_parameters_are_read_as_values() -> None:
    prog = _identity("f32")
    w = torch.nn.Parameter(torch.arange(6, dtype=torch.float32))
    assert prog.run({"x": w})["x"].tolist() == list(range(6))
    t = torch.randn(6, requires_grad=True) * 2  # a non-leaf tensor in a graph
    assert np.array_equal(prog.run({"x": t})["x"], t.detach().numpy())
    assert np.array_equal(prog.run({"x": torch.arange(12.0)[::2]})["x"], np.arange(0.0, 12.0, 2.0))


def test_tensors_cast_like_numpy_arrays() -> None:
    assert _identity("f32").prepare({"x": torch.ones(6, dtype=torch.float64)})["x"].dtype == np.float32
    assert _identity("f32").prepare({"x": torch.ones(6, dtype=torch.int64)})["x"].dtype == np.float32
    exact = _identity("f32").prepare({"x": _values("bf16")})["x"]
    assert exact.tolist() == _values("bf16").float().tolist()
    with pytest.raises(EdlError, match="declared i32, but the value has dtype float32"):
        _identity("i32").prepare({"x": torch.ones(6)})
    with pytest.raises(EdlError, match=r"must have shape \(6,\)"):
        _identity("f32").prepare({"x": torch.ones(5)})


def test_a_tensor_without_data_is_an_edl_error() -> None:
    with pytest.raises(EdlError, match="cannot read the torch tensor for 'x'") as info:
        _identity("f32").prepare({"x": torch.ones(6, device="meta")})
    assert info.value.diagnostic.help is not None


def test_a_type_the_language_lacks_is_an_edl_error() -> None:
    with pytest.raises(EdlError, match="'x' is declared f32, but the value has dtype complex64"):
        _identity("f32").prepare({"x": torch.ones(6, dtype=torch.complex64)})


@pytest.mark.gpu
def test_cuda_tensors_are_copied_to_the_host() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    t = _values("bf16").cuda()
    got = _identity("bf16").prepare({"x": t})["x"]
    assert got.view(np.int16).tolist() == t.cpu().view(torch.int16).tolist()


def test_numpy_values_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import numpy as np\n"
        "import edatalog\n"
        "prog = edatalog.compile_string('input x[2] : f32.\\noutput x.\\n')\n"
        "prog.run({'x': np.zeros(2, np.float32)})\n"
        "prog.run({'x': [1, 2]})\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
