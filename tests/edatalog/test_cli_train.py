"""``edl train``: a checkpoint trained on a token file, saved, resumed, loaded by transformers;
its errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import LlamaForCausalLM

import edatalog
from edatalog.cli import main
from tests.programs.test_llama_model import LLAMA, _model

ARGS = ["--batch", "2", "--seq", "6", "--lr", "1e-2", "--betas", "0.9,0.95", "--weight-decay", "0.1", "--clip", "1.0"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    where = tmp_path_factory.mktemp("train")
    model: Any = _model(layers=2)
    model.save_pretrained(where / "model")
    np.save(where / "tokens.npy", np.random.default_rng(0).integers(0, 37, size=500))
    return where / "model", where / "tokens.npy"


def _train(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, Any]]:
    code = main(["train", str(LLAMA), *argv, "--json", "--dtype", "f64", "--backend", "reference"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


def test_resuming_gives_the_losses_of_an_uninterrupted_run(
    capsys: pytest.CaptureFixture[str], files: tuple[Path, Path], tmp_path: Path
) -> None:
    """4 steps, or 2 saved and 2 more resumed: the same losses; the saved model loads in
    transformers and gives the logits edatalog gives with the saved params."""
    model, data = files
    common = ["--data", str(data), *ARGS]
    whole = _train(capsys, "--weights", str(model), "--steps", "4", *common)
    first = _train(capsys, "--weights", str(model), "--steps", "2", "--save", str(tmp_path / "a"), *common)
    rest = _train(capsys, "--resume", str(tmp_path / "a"), "--steps", "2", *common)
    assert [r["step"] for r in first + rest] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["loss"] for r in first + rest], [r["loss"] for r in whole], rtol=1e-12)
    assert set(whole[0]) >= {"step", "loss", "ms", "predicted_ms", "peak_bytes"}
    assert {p.name for p in (tmp_path / "a").iterdir()} >= {"config.json", "model.safetensors", "optimizer.safetensors"}

    loaded: Any = LlamaForCausalLM.from_pretrained(tmp_path / "a", torch_dtype=torch.float64).eval()  # type: ignore[no-untyped-call]
    dims, consts = _config(tmp_path / "a")
    prog = edatalog.compile(LLAMA, dims={**dims, "S": 5}, consts=consts, dtype="f64")
    ids = [[3, 1, 4, 1, 5]]
    ours = prog.run({**prog.load_checkpoint(tmp_path / "a"), "ids": np.array(ids)})["logits"]
    with torch.no_grad():
        theirs = loaded(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


def _config(path: Path) -> tuple[dict[str, int], dict[str, float]]:
    from edatalog.checkpoint import configured
    from edatalog.lang.parser import parse_file

    return configured(parse_file(str(LLAMA)), path)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_train_to_the_one_process_losses(
    capsys: pytest.CaptureFixture[str], files: tuple[Path, Path], tmp_path: Path
) -> None:
    """--nproc 2 with --memory below what data parallelism holds (every param, gradient and
    AdamW moment on each rank: 515 KB at its predicted peak here, params 86 KB): the solver keeps
    the zero baseline or a refinement of it (the params and moments sharded), and each rank's
    measured peak stays under the limit.  It trains to the one-process losses and saves the same params and state,
    gathered from the ranks' shards; edl explain reads the plan --save-plan kept.  A plan given
    with --plan (run, not solved) that reads the state elsewhere than where the step leaves it
    has it gathered between steps and trains to the same losses too."""
    model, data = files
    argv = ["train", str(LLAMA), "--weights", str(model), "--data", str(data), "--steps", "3", *ARGS, "--json"]
    argv += ["--dtype", "f64"]
    assert main([*argv, "--save", str(tmp_path / "one")]) == 0
    one = [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    plan = tmp_path / "step.json"
    two_argv = [*argv, "--nproc", "2", "--memory", "300KB", "--time-limit", "3", "--save", str(tmp_path / "two")]
    assert main([*two_argv, "--save-plan", str(plan)]) == 0
    two = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert json.loads(plan.read_text())["strategy"] in ("zero", "auto")
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-10)
    assert all(r["predicted_ms"] is not None and 0 < r["peak_bytes"] <= 300_000 for r in two), two
    for name in ("model.safetensors", "optimizer.safetensors"):
        want, got = load_file(str(tmp_path / "one" / name)), load_file(str(tmp_path / "two" / name))
        assert set(got) == set(want)
        for key, value in want.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-10, atol=1e-14, err_msg=key)
    assert main(["explain", str(plan), "grad_layers.0.wq", "--json"]) == 0
    assert list(json.loads(capsys.readouterr().out)) == ["grad_layers.0.wq#layers.0.q"]

    # The zero plan with the params and moments placed whole on both ranks at the start of a
    # step, while the update still makes them sharded: the carried shards are gathered.
    elsewhere = json.loads(plan.read_text())
    carried = {p["relation"] for p in elsewhere["outputs"]}
    for p in elsewhere["inputs"]:
        if f"next_{p['relation']}" in carried:
            p["splits"] = [{**s, "cuts": [0, s["cuts"][-1]]} for s in p["splits"]]
            p["devices"] = [[0, 1]]
    (tmp_path / "elsewhere.json").write_text(json.dumps(elsewhere))
    assert main([*argv, "--nproc", "2", "--plan", str(tmp_path / "elsewhere.json")]) == 0
    out = capsys.readouterr()
    assert "the step's plan" not in out.err  # given, not solved
    gathered = [json.loads(line) for line in out.out.splitlines()]
    np.testing.assert_allclose([r["loss"] for r in gathered], [r["loss"] for r in one], rtol=1e-10)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--lr", "-1"], "--lr must be a positive number"),
        (["--betas", "0.9"], "bad --betas '0.9'"),
        (["--seq", "600"], "has 500 tokens: a sequence needs 601"),
        (["--memory", "1GB"], "--memory, -t and --save-plan plan the step for --nproc processes"),
        (["--data", "missing.npy"], "no such data file: missing.npy"),
    ],
)
def test_bad_flags_are_errors(
    capsys: pytest.CaptureFixture[str], files: tuple[Path, Path], extra: list[str], message: str
) -> None:
    model, data = files
    argv = ["train", str(LLAMA), "--weights", str(model), "--data", str(data), "--steps", "1", *ARGS, *extra]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("start", "message"),
    [
        ([], "training starts from a checkpoint: give --weights"),
        (["--weights", "W", "--resume", "R"], "or --resume (a directory --save wrote), not both"),
    ],
)
def test_a_start_is_one_checkpoint(
    capsys: pytest.CaptureFixture[str], files: tuple[Path, Path], start: list[str], message: str
) -> None:
    _, data = files
    argv = ["train", str(LLAMA), *start, "--data", str(data), "--steps", "1", *ARGS]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_token_outside_the_vocabulary_is_an_error(
    capsys: pytest.CaptureFixture[str], files: tuple[Path, Path], tmp_path: Path
) -> None:
    model, _ = files
    data = np.full(100, 3)
    data[42] = 37
    np.save(tmp_path / "bad.npy", data)
    argv = ["train", str(LLAMA), "--weights", str(model), "--data", str(tmp_path / "bad.npy"), "--steps", "1", *ARGS]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "token 37 at position 42" in err and "outside the vocabulary (V = 37)" in err


def test_resuming_a_model_without_optimizer_state_is_an_error(
    capsys: pytest.CaptureFixture[str], files: tuple[Path, Path]
) -> None:
    model, data = files
    argv = ["train", str(LLAMA), "--resume", str(model), "--data", str(data), "--steps", "1", *ARGS]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "has no optimizer state (optimizer.safetensors)" in err


def test_a_loss_that_is_not_one_cell_is_an_error() -> None:
    prog = edatalog.compile_string("dim I = 3.\nparam a[I] : f64.\noutput l.\nl[i] = a[i] * a[i].\n", name="l.edl")
    with pytest.raises(edatalog.EdlError, match="the loss must be a scalar"):
        edatalog.Trainer(prog)
