"""The `edl` command line, run in-process and once as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import edatalog
from edatalog.cli import main

ROOT = Path(__file__).resolve().parents[2]
ATTN = str(ROOT / "programs" / "attention.edl")
SMALL = ["--dim", "B=1", "--dim", "S=6", "--dim", "D=16", "--dim", "H=2"]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_check_prints_a_table_of_relations(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "check", ATTN, *SMALL)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["relation", "kind", "shape", "dtype", "size", "rules", "flops", "support"]
    sc = next(line for line in lines if line.startswith("sc "))
    assert "[B=1, H=2, S=6, S=6]" in sc and sc.endswith("t <= s")
    assert "ok, 9 rules" in out


def test_check_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "check", ATTN, *SMALL, "--json")
    data = json.loads(out)
    assert code == 0 and data["ok"]
    rels = {r["name"]: r for r in data["relations"]}
    assert rels["y"]["output"] and rels["y"]["shape"] == [1, 6, 16]
    assert rels["sc"]["support"] == "t <= s"
    assert data["total_flops"] == sum(n["flops"] for n in data["nodes"]) > 0
    assert rels["x"]["bytes"] == 1 * 6 * 16 * 4


def test_compile_prints_the_graph_and_writes_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "g.json"
    code, out, _ = _run(capsys, "compile", ATTN, *SMALL, "-o", str(target))
    assert code == 0
    assert "sc[b,h,s,t] += q[b,s,h,e] * k[b,t,h,e] / sqrt(E) where t <= s" in out
    from edatalog.ir.graph import Graph

    g = Graph.from_json(target.read_text())
    assert g.outputs == ("y",)
    code, out, _ = _run(capsys, "compile", ATTN, *SMALL, "--json")
    assert Graph.from_json(out) == g


def test_run_with_random_inputs_saves_outputs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "out.npz"
    code, out, _ = _run(capsys, "run", ATTN, *SMALL, "--random", "0", "-o", str(target))
    assert code == 0
    assert out.splitlines()[0].split() == ["output", "shape", "dtype", "norm", "mean", "absent", "finite"]
    with np.load(target) as saved:
        assert saved["y"].shape == (1, 6, 16)


def test_run_with_inputs_file_matches_the_api(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import edatalog

    prog = edatalog.compile(ATTN, dims={"B": 1, "S": 6, "D": 16, "H": 2})
    values = prog.random_inputs(7)
    from safetensors.numpy import save_file

    src = tmp_path / "in.safetensors"
    save_file(values, str(src))
    code, out, _ = _run(capsys, "run", ATTN, *SMALL, "--inputs", str(src), "--json")
    assert code == 0
    norm = json.loads(out)["outputs"]["y"]["norm"]
    assert norm == pytest.approx(float(np.linalg.norm(prog.run(values)["y"].astype(np.float64))), rel=1e-6)


def test_user_mistakes_are_diagnostics_not_tracebacks(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.edl"
    bad.write_text("input x[4] : f32.\ny[i] = xx[i].\n")
    code, out, err = _run(capsys, "check", str(bad))
    assert code == 1 and out == ""
    assert err.startswith(f"{bad}:2:8: error: undefined relation 'xx'")
    assert "Traceback" not in err
    for argv in (
        ["run", ATTN, "--dim", "S=x", "--random", "0"],
        ["run", ATTN, "--dim", "Q=3", "--random", "0"],
        ["run", ATTN],
        ["run", ATTN, *SMALL, "--inputs", str(tmp_path / "missing.npz")],
        ["check", str(tmp_path / "nope.edl")],
    ):
        code, _, err = _run(capsys, *argv)
        assert code == 1, argv
        assert "error:" in err and "Traceback" not in err, argv


def test_help_teaches(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--random SEED" in out and "examples:" in out and "--dim K=V" in out


def test_edl_entry_point_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "edatalog.cli", "check", str(ROOT / "programs" / "softmax.edl")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ok, 4 rules" in proc.stdout


def test_run_draws_only_the_inputs_the_file_does_not_give(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import edatalog

    prog = edatalog.compile(ATTN, dims={"B": 1, "S": 6, "D": 16, "H": 2})
    x = np.full((1, 6, 16), 0.5, np.float32)
    src = tmp_path / "x.npz"
    np.savez(src, x=x)
    code, out, _ = _run(capsys, "run", ATTN, *SMALL, "--inputs", str(src), "--random", "3", "--json")
    assert code == 0
    values = {**prog.random_inputs(3), "x": x}  # each value depends only on the seed and its name
    expected = float(np.linalg.norm(prog.run(values)["y"].astype(np.float64)))
    assert json.loads(out)["outputs"]["y"]["norm"] == pytest.approx(expected, rel=1e-6)


def test_bad_paths_and_seeds_fail_before_any_work(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for argv in (
        ["run", ATTN, *SMALL, "--random", "0", "-o", str(tmp_path / "out.txt")],
        ["run", ATTN, *SMALL, "--random", "0", "-o", str(tmp_path / "no" / "out.npz")],
        ["compile", ATTN, "-o", str(tmp_path / "no" / "g.json")],
    ):
        code, out, err = _run(capsys, *argv)
        assert code == 1 and out == "" and "error:" in err, argv
    with pytest.raises(SystemExit) as info:
        main(["run", ATTN, "--random", "-1"])
    assert info.value.code == 2
    assert "non-negative" in capsys.readouterr().err
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not a safetensors file")
    code, _, err = _run(capsys, "run", ATTN, *SMALL, "--inputs", str(broken))
    assert code == 1 and "cannot read inputs" in err


def test_a_file_that_is_not_an_npz_archive_never_suggests_pickle(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    text = tmp_path / "x.npz"
    text.write_text("x = 1, 2, 3\n")
    code, _, err = _run(capsys, "run", ATTN, *SMALL, "--inputs", str(text))
    assert code == 1 and f"error: {text} is not an .npz archive" in err
    assert "help: write inputs with numpy.savez" in err and "pickle" not in err
    objects = tmp_path / "objects.npz"
    np.savez(objects, x=np.array([{"a": 1}], dtype=object))
    code, _, err = _run(capsys, "run", ATTN, *SMALL, "--inputs", str(objects))
    assert code == 1 and "it holds Python objects, and edatalog reads only plain arrays" in err
    assert "allow_pickle" not in err


def test_run_times_only_the_work(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What ops load on first use (torch, for gelu) is loaded before the clock starts, so the
    FLOP/s printed are the work's.  Checked by the order of events, not by timing anything."""
    from edatalog.backend.kernels import ops
    from edatalog.cli import programs

    events: list[str] = []
    warm_up = ops.warm_up

    def recording_warm_up(ops: Any) -> None:
        ops = set(ops)
        events.append("warm " + ",".join(sorted(ops & {"gelu", "erf"})))
        warm_up(ops)

    class Clock:
        def perf_counter(self) -> float:
            events.append("clock")
            return float(len(events))

    monkeypatch.setattr(ops, "warm_up", recording_warm_up)
    monkeypatch.setattr(programs, "time", Clock())
    src = tmp_path / "gelu.edl"
    src.write_text("dim N = 4.\ninput x[N] : f32.\ny[i] = gelu(x[i]) + exp(x[i]).\n")
    code, out, _ = _run(capsys, "run", str(src), "--random", "0")
    assert code == 0 and "FLOP/s" in out
    assert events == ["warm gelu", "clock", "clock"]


def test_warm_up_loads_torch_only_for_the_ops_that_need_it() -> None:
    code = (
        "import sys\n"
        "from edatalog.backend.kernels import ops\n"
        "ops.warm_up(['exp', 'silu', 'no such op'])\n"
        "assert 'torch' not in sys.modules\n"
        "ops.warm_up(['gelu'])\n"
        "assert 'torch' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_a_program_without_rules_warns(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    empty = tmp_path / "empty.edl"
    empty.write_text("# nothing yet\n")
    code, out, err = _run(capsys, "check", str(empty))
    assert code == 0 and "ok, 0 rules" in out and "1 warning" in out
    assert err.startswith("warning: the program has no rules: it computes nothing and has no outputs")


def test_run_refuses_a_program_too_big_before_drawing_inputs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--dim S=1000000000`` needs about a terabyte: a diagnostic with the bytes, not numpy's
    MemoryError after drawing inputs (it returns at once: nothing is allocated)."""
    prog = tmp_path / "ln_linear.edl"
    prog.write_text(
        "dim B = 1, S = 128, D = 256, F = 512.\ninput x[B, S, D] : f32.\nparam w[F, D] : f32.\n"
        "y[b, s, f] += x[b, s, d] * w[f, d].\n"
    )
    assert main(["run", str(prog), "--dim", "S=1000000000", "--random", "0"]) == 1
    err = capsys.readouterr().err
    assert "ln_linear.edl:2:7: error: not enough memory: input 'x' needs a [1, 1000000000, 256] f32 buffer" in err
    assert "954 GiB" in err
    assert "Traceback" not in err


def test_run_with_torch_measures_time_and_memory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``edl run --backend torch`` (here without a plan: one device) reports what it measured:
    each call's time, and the device's peak memory, which holds at least the weights."""
    code, out, err = _run(capsys, "run", str(ROOT / "programs" / "mlp.edl"), "--backend", "torch", "--random", "0")
    assert code == 0, err
    assert "ran the program on one device with torch in this process" in out
    assert "peak memory per device (measured): 0: " in out
    code, out, err = _run(
        capsys,
        "run",
        str(ROOT / "programs" / "mlp.edl"),
        "--backend",
        "torch",
        "--random",
        "0",
        "--repeat",
        "2",
        "--json",
    )
    assert code == 0, err
    report = json.loads(out)
    assert len(report["calls_ms"]) == 2 and report["measured_ms"] > 0 and report["predicted_ms"] is None
    prog = edatalog.compile(ROOT / "programs" / "mlp.edl")
    weights = sum(r.nbytes for r in prog.arguments if r.kind == "param")
    assert set(report["peak_memory"]) == {"0"} and report["peak_memory"]["0"] >= weights


def test_notices_are_printed_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    """A long step the runtime announces (an inductor compile) reaches a command-line user."""
    from edatalog.errors import NOTICES

    handlers, level = list(NOTICES.handlers), NOTICES.level
    try:
        with pytest.raises(SystemExit):
            main(["--version"])
        NOTICES.info("compiling %d ops with inductor", 3)
        assert "edl: compiling 3 ops with inductor" in capsys.readouterr().err
    finally:  # later tests see the logger as it was
        NOTICES.handlers[:] = handlers
        NOTICES.setLevel(level)
