"""Golden error messages of running a program and loading its weights: every
``tests/golden/runtime/NAME.edl`` compiles, then fails at run time with the exact text of
``NAME.expected``.  Its first line says what to do:

- ``# inputs: ids=[[0, 6, 7]]``: run the program on these inputs (and random params);
- ``# checkpoint: NAME DTYPE SHAPE; ...``: write a safetensors checkpoint of zeros with these
  tensors and load it (``Program.load_checkpoint``); its path reads ``<checkpoint>`` in the text.

Regenerate with ``pytest --update-goldens`` after a deliberate change, and review the diff.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import edatalog

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "runtime"
CASES = sorted(GOLDEN.glob("*.edl"))
TORCH_DTYPES = {"f32": torch.float32, "f64": torch.float64, "bf16": torch.bfloat16, "i64": torch.int64}


def _failure(path: Path, tmp: Path) -> str:
    text = path.read_text(encoding="utf-8")
    first = text.splitlines()[0]
    prog = edatalog.compile_string(text, name=path.relative_to(ROOT).as_posix())
    kind, _, spec = first.removeprefix("#").partition(":")
    if kind.strip() == "inputs":
        name, _, value = spec.partition("=")
        values = prog.random_inputs(0)
        values[name.strip()] = json.loads(value)
        with pytest.raises(edatalog.EdlError) as caught:
            prog.run(values)
    elif kind.strip() == "checkpoint":
        tensors = {}
        for item in spec.split(";"):
            name, dtype, shape = item.split()
            tensors[name] = torch.zeros([int(n) for n in shape.split(",")], dtype=TORCH_DTYPES[dtype])
        save_file(tensors, str(tmp / "model.safetensors"))
        with pytest.raises(edatalog.EdlError) as caught:
            prog.load_checkpoint(tmp)
    else:
        raise AssertionError(f"{path.name}: the first line says what to do ('# inputs:' or '# checkpoint:')")
    return str(caught.value).replace(str(tmp), "<checkpoint>")


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_runtime_error_message(path: Path, tmp_path: Path, update_goldens: bool) -> None:
    got = _failure(path, tmp_path)
    expected = path.with_suffix(".expected")
    if update_goldens:
        expected.write_text(got + "\n", encoding="utf-8")
        return
    assert expected.exists(), f"no {expected.name}: run pytest --update-goldens"
    assert got + "\n" == expected.read_text(encoding="utf-8")


def test_every_new_error_path_has_a_golden_case() -> None:
    """The error paths of whole models: a gather id out of range, a checkpoint name missing, a
    shape mismatch, a layer-count mismatch (and a dtype mismatch)."""
    names = {p.stem for p in CASES}
    assert {
        "gather_out_of_range",
        "checkpoint_name_missing",
        "checkpoint_shape_mismatch",
        "checkpoint_layer_count",
        "checkpoint_dtype_mismatch",
    } <= names
