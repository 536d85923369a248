"""``programs/gpt2.edl`` against transformers' ``GPT2LMHeadModel``, with random weights that
transformers itself saves (``save_pretrained``, safetensors: the LM head tied to the token
embedding, so the file holds it once) and edatalog loads by the names the program declares.

The configuration is small and odd: 2 layers, 3 heads of 4, an MLP of 37 (``n_inner``), a
vocabulary of 41 and 16 positions, of which the prompt uses fewer; float64 throughout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import edatalog
from edatalog.checkpoint import configured
from edatalog.lang.parser import parse_file

ROOT = Path(__file__).resolve().parents[2]
GPT2 = ROOT / "programs" / "gpt2.edl"
PROMPT = [3, 17, 40, 0, 9, 9, 25]
TOL = 1e-9


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=41, n_positions=16, n_embd=12, n_layer=2, n_head=3, n_inner=37, layer_norm_epsilon=1e-4
    )
    model: Any = cast(Any, GPT2LMHeadModel)(config).double().eval()
    with torch.no_grad():  # weights large enough that every part of the block matters
        for _, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 1.5 / min(p.shape) ** 0.5)
            else:
                p.normal_(0.5, 0.5)
    where = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(where)
    return where, model


def _compile(where: Path) -> edatalog.Program:
    dims, consts = configured(parse_file(str(GPT2)), where)
    return edatalog.compile(GPT2, dims={**dims, "S": len(PROMPT)}, consts=consts, dtype="f64")


def test_the_config_sets_the_dims(saved: tuple[Path, Any]) -> None:
    dims, consts = configured(parse_file(str(GPT2)), saved[0])
    assert dims == {"D": 12, "H": 3, "F": 37, "L": 2, "V": 41, "P": 16}
    assert consts == {"eps": 1e-4}


def test_logits_equal_transformers_from_its_own_checkpoint(saved: tuple[Path, Any]) -> None:
    where, model = saved
    prog = _compile(where)
    params = prog.load_checkpoint(where)
    assert np.array_equal(params["lm_head"], params["wte"])  # tied: the head reads the embedding
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits.numpy()
    for backend in ("reference", "torch"):
        out = np.asarray(prog.run({**params, "ids": np.array([PROMPT])}, backend=backend)["logits"])
        assert np.linalg.norm(out - ref) <= TOL * np.linalg.norm(ref), backend
    # The comparison means something: the positions and the second layer change the logits.
    for name, other in (("wpe", "wpe"), ("layers.1.mlp_c_fc_bias", "layers.0.mlp_c_fc_bias")):
        changed = dict(params)
        changed[name] = params[other][::-1].copy()
        out = prog.run({**changed, "ids": np.array([PROMPT])})["logits"]
        assert np.linalg.norm(out - ref) > 1e-3 * np.linalg.norm(ref), name


def test_n_inner_none_means_four_times_the_width(tmp_path: Path) -> None:
    GPT2Config(vocab_size=11, n_positions=8, n_embd=8, n_layer=1, n_head=2).save_pretrained(tmp_path)
    dims, _ = configured(parse_file(str(GPT2)), tmp_path)
    prog = edatalog.compile(GPT2, dims={**dims, "S": 4})
    assert "F" not in dims and prog.graph.relation("layers.0.mlp_c_fc_weight").shape == (8, 32)
