"""``edl run --weights``: a transformers checkpoint on the command line, planned and run on two
ranks; a checkpoint given as --inputs; a rank's error as it reads in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from edatalog.cli import main

ROOT = Path(__file__).resolve().parents[2]
GPT2 = str(ROOT / "programs" / "gpt2.edl")
IDS = np.array([[3, 17, 40, 0, 9, 9, 25, 1]])


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=41, n_positions=16, n_embd=12, n_layer=2, n_head=3, n_inner=37)
    model: Any = GPT2LMHeadModel(config).eval()  # type: ignore[no-untyped-call]
    where = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(where / "model")
    return where, model


@pytest.mark.distributed
def test_a_checkpoint_runs_under_a_solved_plan_on_two_ranks(
    saved: tuple[Path, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """GPT2LMHeadModel.save_pretrained's directory: dims from its config.json, params by their
    checkpoint names, the logits transformers gives; then an id outside the vocabulary, which
    the rank reports as one process would (the cell, the rule, the file and line)."""
    where, model = saved
    np.savez(where / "ids.npz", ids=IDS)
    weights = ["--weights", str(where / "model"), "--dim", "S=8"]
    plan = ["--plan", str(where / "plan.json"), "--backend", "torch", "--nproc", "2"]
    assert main(["plan", GPT2, *weights, "-t", "cpux2", "--time-limit", "2", "-o", str(where / "plan.json")]) == 0
    argv = ["run", GPT2, *weights, "--inputs", str(where / "ids.npz"), *plan, "-o", str(where / "out.npz")]
    assert main(argv) == 0, capsys.readouterr().err
    with torch.no_grad():
        want = model(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(np.load(where / "out.npz")["logits"], want, rtol=1e-5, atol=1e-6)

    bad = IDS.copy()
    bad[0, 2] = 999
    np.savez(where / "bad.npz", ids=bad)
    capsys.readouterr()
    assert main(["run", GPT2, *weights, "--inputs", str(where / "bad.npz"), *plan]) == 1
    err = capsys.readouterr().err
    assert "failed (exit code 1): " in err and "gpt2.edl:" in err
    assert "ids[0, 2] = 999 is out of range: rule 'x0' looks it up as index 'v'" in err, err
    assert "help: every value of 'ids' must be below 41" in err


def test_a_checkpoint_given_as_inputs_says_to_pass_it_as_weights(
    saved: tuple[Path, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    where, _ = saved
    checkpoint = str(where / "model" / "model.safetensors")
    assert main(["run", GPT2, "--inputs", checkpoint, "--dim", "S=8", "--dim", "V=41", "--random", "0"]) == 1
    err = capsys.readouterr().err
    assert "holds checkpoint names" in err and f"--weights {checkpoint}" in err


def test_weights_on_the_reference_give_transformers_logits(
    saved: tuple[Path, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    where, model = saved
    np.savez(where / "ids.npz", ids=IDS)
    out = where / "ref.npz"
    argv = ["run", GPT2, "--weights", str(where / "model"), "--dim", "S=8", "--inputs", str(where / "ids.npz")]
    assert main([*argv, "-o", str(out)]) == 0, capsys.readouterr().err
    with torch.no_grad():
        want = model(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(np.load(out)["logits"], want, rtol=1e-5, atol=1e-6)
