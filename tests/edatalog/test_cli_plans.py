"""`edl plan`, `edl query`, `edl explain` and `edl run --plan`, run in-process (`edl show`: test_show.py).

Small dims everywhere: every plan here is synthesized and simulated in well under a second.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import edatalog
from edatalog import EdlError
from edatalog.cli import main

ROOT = Path(__file__).resolve().parents[2]
LLAMA = str(ROOT / "programs" / "llama_block.edl")
ATTN = str(ROOT / "programs" / "attention.edl")
MLP = str(ROOT / "programs" / "mlp.edl")
# Grouped-query attention: 8 query heads share 2 key/value heads (G = 4).
GQA = ["--dim", "S=8", "--dim", "D=64", "--dim", "H=8", "--dim", "KVH=2", "--dim", "F=48"]
GQA_DIMS = {"S": 8, "D": 64, "H": 8, "KVH": 2, "F": 48}
ATTN_SMALL = ["--dim", "B=1", "--dim", "S=8", "--dim", "D=16", "--dim", "H=2"]
MLP_SMALL = ["--dim", "B=4", "--dim", "D=32", "--dim", "F=64"]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _quiet(*argv: str) -> None:
    """Run a command whose output does not matter (to make a plan file for a test)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(list(argv)) == 0


def _fails(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """A command that must fail as a diagnostic: status 1, ``error: ...`` on stderr, no traceback."""
    code, out, err = _run(capsys, *argv)
    assert code == 1, (out, err)
    assert err.startswith("error: "), err
    assert "Traceback" not in err
    return err


@pytest.fixture(scope="module")
def gqa_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A megatron plan of the LLaMA block with grouped-query attention on 8 devices."""
    path = tmp_path_factory.mktemp("plans") / "gqa.json"
    _quiet("plan", LLAMA, *GQA, "-t", "a100x8", "-s", "megatron", "-o", str(path))
    return path


# -- edl plan -------------------------------------------------------------------------------------


def test_plan_prints_placements_tiles_machine_and_cost(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "plan", LLAMA, *GQA, "-t", "a100x8", "-s", "megatron")
    assert code == 0
    fingerprint = edatalog.compile(LLAMA, dims=GQA_DIMS).graph.fingerprint()
    lines = out.splitlines()
    assert lines[0] == f"plan 'megatron' for 8 devices (a100x8), program {fingerprint}"
    assert lines[1] == "inputs and params:"
    rows = {line.split()[0]: line.split(None, 1)[1] for line in lines if line.startswith("  ")}
    assert rows["x"] == "R"
    assert rows["wq"] == "S(0)"
    assert rows["wo"] == "S(1)"
    # Two key/value heads on eight devices: query heads split (g, r) = 2 x 4, each k/v head
    # replicated on the four devices whose query heads read it.
    assert rows["q"] == "b:1 s:1 g:2 r:4 e:1 d:1 -> devices 0..7"
    assert rows["k"] == "b:1 t:1 g:2 e:1 d:1 -> devices [{0,1,2,3},{4,5,6,7}]"
    assert rows["wk"] == "a0:2 d:1 -> devices [{0,1,2,3},{4,5,6,7}]"
    assert rows["gate"] == "b:1 s:1 f:8 d:1 -> devices 0..7"
    assert rows["ss"] == "b:1 s:1 d:1 -> {0..7}"
    assert "outputs:" in lines
    assert "a100x8: 8 x A100-80GB (8 per node), nvlink 230 GB/s (72 GB/s per pair)" in lines
    assert any(line.split() == ["device", "flops", "peak", "memory", "sent", "received"] for line in lines)
    assert any(line.split() == ["link", "kind", "bytes"] for line in lines)
    assert lines[-1].startswith("predicted ") and " ms on a100x8, " in lines[-1]


def test_plan_json_summary_adds_up(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "plan", ATTN, *ATTN_SMALL, "-t", "a100x4", "-s", "megatron", "--json")
    assert code == 0
    data = json.loads(out)
    assert set(data) == {"summary", "plan"}
    summary, plan = data["summary"], data["plan"]
    assert plan["format"] == 1 and plan["kind"] == "edatalog-plan"
    assert plan["program"] == edatalog.compile(ATTN, dims={"B": 1, "S": 8, "D": 16, "H": 2}).graph.fingerprint()
    assert summary["strategy"] == "megatron" and summary["topology"] == "a100x4" and summary["devices"] == 4
    assert summary["predicted_ms"] > 0
    moved = sum(summary["bytes_per_link"].values())
    assert moved == summary["bytes_moved"] == sum(summary["sent"].values()) == sum(summary["received"].values()) > 0
    assert set(summary["peak_memory"]) == {"0", "1", "2", "3"}


def test_data_parallel_splits_the_work_without_moving_anything(capsys: pytest.CaptureFixture[str]) -> None:
    dims = ["--dim", "B=4", "--dim", "S=8", "--dim", "D=16", "--dim", "H=2"]
    total = sum(c.flops for c in edatalog.compile(ATTN, dims={"B": 4, "S": 8, "D": 16, "H": 2}).graph.costs.values())
    _, out, _ = _run(capsys, "plan", ATTN, *dims, "-t", "a100x4", "-s", "data", "--json")
    data = json.loads(out)["summary"]
    assert data["bytes_moved"] == 0
    _, out, _ = _run(capsys, "plan", ATTN, *dims, "-t", "a100x4", "-s", "replicate", "--json")
    rep = json.loads(out)["summary"]
    # The same kernels, on one device or split by batch over four: flash attention computes whole
    # tiles (here one 8 x 8 tile per head, diagonal included), so more than the causal points.
    assert sum(data["flops"].values()) == rep["flops"]["0"] > total
    assert rep["flops"] == {"0": rep["flops"]["0"], "1": 0, "2": 0, "3": 0}


def test_plan_writes_the_plan_and_a_chrome_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plan_path, trace_path = tmp_path / "p.json", tmp_path / "t.json"
    code, out, _ = _run(  # on gloo, Megatron-SP's reduce-scatters are messages (on NCCL, collectives)
        capsys,
        "plan",
        LLAMA,
        *GQA,
        "-t",
        "cpux4",
        "-s",
        "megatron-sp",
        "-o",
        str(plan_path),
        "--trace",
        str(trace_path),
    )
    assert code == 0
    assert f"wrote plan {plan_path}" in out and f"wrote trace {trace_path}" in out
    saved = json.loads(plan_path.read_text())
    assert {"format", "program", "machine", "graph", "reduction"} <= set(saved)
    assert saved["machine"]["name"] == "cpux4" and saved["machine"]["nodes"] == [4]

    trace: dict[str, Any] = json.loads(trace_path.read_text())
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {d: f"device {d}" for d in range(4)}
    spans = [e for e in events if e["ph"] == "X"]
    for e in spans:
        assert e["ts"] >= 0 and e["dur"] >= 0 and e["pid"] in names and e["tid"] in (0, 1, 2)
    for d in range(4):
        assert any(e["pid"] == d and e["cat"] == "compute" for e in spans), d
    sends = [e for e in spans if e["cat"] == "send"]
    assert sends and len(sends) == len([e for e in spans if e["cat"] == "recv"])
    assert sum(e["args"]["bytes"] for e in sends) == edatalog.load_plan(plan_path).report.bytes_moved
    end_us = max(e["ts"] + e["dur"] for e in spans)
    assert trace["otherData"]["predicted_ms"] == pytest.approx(end_us / 1e3)


def test_hierarchical_reduction_moves_less_between_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    dims = ["--dim", "S=8", "--dim", "D=64", "--dim", "H=8", "--dim", "KVH=8", "--dim", "F=64"]
    between: dict[str, int] = {}
    for reduction in ("direct", "hierarchical", "auto"):
        code, out, _ = _run(
            capsys,
            *("plan", LLAMA, *dims, "-t", "2x4", "-s", "megatron", "--reduction", reduction, "--json"),
            *("--collectives", "off"),  # reductions by messages, not NCCL's rings
        )
        assert code == 0
        links = json.loads(out)["summary"]["bytes_per_link"]
        between[reduction] = sum(
            v for k, v in links.items() if int(k.split("->")[0]) // 4 != int(k.split("->")[1]) // 4
        )
    assert between["hierarchical"] < between["direct"]
    assert between["auto"] == between["hierarchical"]  # InfiniBand is slower than NVLink


# -- edl query ------------------------------------------------------------------------------------


def test_query_summary_repeats_the_plan(capsys: pytest.CaptureFixture[str], gqa_plan: Path) -> None:
    _, planned, _ = _run(capsys, "plan", LLAMA, *GQA, "-t", "a100x8", "-s", "megatron")
    code, out, _ = _run(capsys, "query", str(gqa_plan))
    assert code == 0
    tiles = planned.split("\n\n")[0]
    assert out.startswith(tiles + "\n\n")
    assert out.splitlines()[-1] == planned.splitlines()[-1]  # the same prediction


def test_query_json_is_the_summary(capsys: pytest.CaptureFixture[str], gqa_plan: Path) -> None:
    code, out, _ = _run(capsys, "query", str(gqa_plan), "--json")
    assert code == 0
    assert json.loads(out) == json.loads(json.dumps(edatalog.load_plan(gqa_plan).summary()))


def test_query_a_relation_shows_blocks_and_where_it_lives(capsys: pytest.CaptureFixture[str], gqa_plan: Path) -> None:
    code, out, _ = _run(capsys, "query", str(gqa_plan), "attn")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "derived attn [1, 8, 64] : f32"
    assert "computed as" in lines and "lives at" in lines
    computed = [line.split() for line in lines if line.startswith("attn ")]
    assert [row[1] for row in computed] == [str(k) for k in range(8)]  # one block per device
    assert [row[-1] for row in computed] == [str(k) for k in range(8)]
    # the partial sums over heads are reduce-scattered: each device ends with an eighth of d
    assert "b 0:1, s 0:8, d 8:16   1" in lines

    code, out, _ = _run(capsys, "query", str(gqa_plan), "y")
    assert "lives at (the end of the run)" in out
    assert out.rstrip().endswith("0,1,2,3,4,5,6,7")  # outputs end replicated


def test_query_a_relation_json(capsys: pytest.CaptureFixture[str], gqa_plan: Path) -> None:
    code, out, _ = _run(capsys, "query", str(gqa_plan), "k", "--json")
    assert code == 0
    view = json.loads(out)
    assert view["relation"] == "k" and view["kind"] == "derived" and view["shape"] == [1, 8, 2, 8]
    assert [c["devices"] for c in view["computed"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [c["ranges"]["g"] for c in view["computed"]] == [{"start": 0, "stop": 1}, {"start": 1, "stop": 2}]
    assert not any(c["empty"] for c in view["computed"])
    assert [e["devices"] for e in view["lives"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_query_marks_causal_blocks_skipped(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Random plans cut s and t of the scores; blocks wholly above the diagonal are never computed."""
    from edatalog.solver.strategies import random_plan

    graph = edatalog.compile(ATTN, dims={"B": 1, "S": 8, "D": 16, "H": 2}).graph
    machine = edatalog.topology("a100x2")

    def above_diagonal(seed: int) -> bool:
        tile = random_plan(graph, machine, seed).node("sc").tile
        return any(b.ranges["t"][0] >= b.ranges["s"][1] for b in tile.blocks())

    seed = next((k for k in range(100) if above_diagonal(k)), None)
    assert seed is not None, "no random plan of 100 cuts the scores above the diagonal"
    path = tmp_path / "r.json"
    _quiet("plan", ATTN, *ATTN_SMALL, "-t", "a100x2", "-s", "random", "--seed", str(seed), "-o", str(path))
    _, out, _ = _run(capsys, "query", str(path), "sc", "--json")
    computed = json.loads(out)["computed"]
    assert any(c["empty"] for c in computed)
    for c in computed:
        s1, t0 = c["ranges"]["s"]["stop"], c["ranges"]["t"]["start"]
        assert c["empty"] == (t0 >= s1)  # no point where t <= s
    _, text, _ = _run(capsys, "query", str(path), "sc")
    assert "skipped (empty)" in text


def test_query_mistakes(capsys: pytest.CaptureFixture[str], gqa_plan: Path, tmp_path: Path) -> None:
    err = _fails(capsys, "query", str(gqa_plan), "atn")
    assert "no relation 'atn'" in err and "did you mean 'attn'" in err
    _fails(capsys, "query", str(tmp_path / "missing.json"))
    (tmp_path / "text.json").write_text("not json")
    assert "not a plan file" in _fails(capsys, "query", str(tmp_path / "text.json"))
    (tmp_path / "other.json").write_text('{"a": 1}')
    assert "not a plan file" in _fails(capsys, "query", str(tmp_path / "other.json"))
    data = json.loads(gqa_plan.read_text())
    data["format"] = 99
    (tmp_path / "future.json").write_text(json.dumps(data))
    assert "plan format 99" in _fails(capsys, "query", str(tmp_path / "future.json"))


def test_query_prints_strided_regions_truly(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    src, path = tmp_path / "comp.edl", tmp_path / "p.json"
    src.write_text("dim H = 2, E = 4.\ninput x[H, E] : f32.\noutput z.\nz[(h, e)] = x[h, e] * 2.0.\n")
    _quiet("plan", str(src), "-t", "a100x2", "-s", "replicate", "-o", str(path))
    data = json.loads(path.read_text())  # a plan written by hand: e cut at 1, so block 0 writes z[0] and z[4]
    (node,) = data["nodes"]
    node["splits"] = [{"index": "h", "cuts": [0, 2]}, {"index": "e", "cuts": [0, 1, 4]}]
    node["devices"] = [[0], [1]]
    path.write_text(json.dumps(data))
    code, out, _ = _run(capsys, "query", str(path), "z")
    assert code == 0
    assert "a0 0:4 " not in out


# -- edl run --plan -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("program", "dims", "topology", "strategy"),
    [
        (LLAMA, GQA, "a100x8", "megatron"),
        (LLAMA, GQA, "2x4", "megatron"),
        (LLAMA, GQA, "a100x4", "data"),
        (ATTN, ATTN_SMALL, "a100x3", "random"),
        (LLAMA, GQA, "a100x3", "auto"),
    ],
)
def test_run_a_plan_matches_the_reference(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, program: str, dims: list[str], topology: str, strategy: str
) -> None:
    plan_path, trace = tmp_path / "p.json", tmp_path / "t.json"
    planned, reference = tmp_path / "sim.npz", tmp_path / "ref.npz"
    _quiet("plan", program, *dims, "-t", topology, "-s", strategy, "--time-limit", "1", "-o", str(plan_path))
    argv = ["run", program, *dims, "--plan", str(plan_path), "--backend", "sim", "--random", "3", "-o", str(planned)]
    argv += ["--trace", str(trace)]
    code, out, _ = _run(capsys, *argv, "--json")
    assert code == 0
    data = json.loads(out)
    assert data["backend"] == "sim" and data["predicted_ms"] > 0
    assert json.loads(trace.read_text())["otherData"]["predicted_ms"] == pytest.approx(data["predicted_ms"])
    assert main(["run", program, *dims, "--random", "3", "-o", str(reference)]) == 0
    capsys.readouterr()
    with np.load(planned) as a, np.load(reference) as b:
        np.testing.assert_allclose(a["y"], b["y"], rtol=1e-5, atol=1e-5)


def test_run_a_plan_reports_the_simulation(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plan_path, trace = tmp_path / "p.json", tmp_path / "t.json"
    _quiet("plan", MLP, *MLP_SMALL, "-t", "h100x2", "-s", "megatron", "-o", str(plan_path))
    # --backend sim is implied by --plan
    code, out, _ = _run(
        capsys, "run", MLP, *MLP_SMALL, "--plan", str(plan_path), "--random", "0", "--trace", str(trace)
    )
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["output", "shape", "dtype", "norm", "mean", "absent", "finite"]
    assert " of the megatron plan on 2 simulated devices in " in out and "ms on h100x2, " in out
    assert lines[-1] == f"wrote trace {trace}"


def test_a_plan_for_another_program_is_refused(capsys: pytest.CaptureFixture[str], gqa_plan: Path) -> None:
    other_dims = [*GQA[:-2], "--dim", "F=64"]
    err = _fails(capsys, "run", LLAMA, *other_dims, "--plan", str(gqa_plan), "--random", "0")
    assert "was made for another program: its dims differ: F=48 (here 64)" in err
    assert "help: make a new plan with these dims" in err
    err = _fails(capsys, "run", MLP, "--plan", str(gqa_plan), "--random", "0")
    assert "this plan was made for another program" in err
    with pytest.raises(EdlError, match="made for another program"):
        edatalog.load_plan(gqa_plan, edatalog.compile(LLAMA, dims={**GQA_DIMS, "S": 16}))


def test_run_plan_mistakes(capsys: pytest.CaptureFixture[str], gqa_plan: Path) -> None:
    assert "the sim backend runs a plan" in _fails(capsys, "run", MLP, "--backend", "sim", "--random", "0")
    assert "--trace needs a plan" in _fails(capsys, "run", MLP, "--trace", "t.json", "--random", "0")
    err = _fails(capsys, "run", LLAMA, *GQA, "--plan", str(gqa_plan), "--backend", "reference", "--random", "0")
    assert "reference backend" in err


# -- machines -------------------------------------------------------------------------------------

TOML_MACHINE = """\
name = "my-box"
nodes = [2, 2]
[device]
kind = "A100-80GB"
memory = "80GiB"
flops = "312TFLOPS"
bandwidth = "2TB/s"
[links.intra]
name = "nvlink"
bandwidth = "300GB/s"
latency = "3us"
[links.inter]
name = "ib"
bandwidth = "25GB/s"
latency = "10us"
"""


def test_custom_machine_toml(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "box.toml"
    path.write_text(TOML_MACHINE)
    machine = edatalog.topology(str(path))
    assert machine.nodes == ((0, 1), (2, 3))
    assert machine.devices[0].memory == 80 * 2**30 and machine.devices[3].flops == 312e12
    assert machine.devices[0].bandwidth == 2e12
    assert machine.intra.bandwidth == 300e9 and machine.intra.latency == pytest.approx(3e-6)
    assert machine.inter is not None and (machine.inter.name, machine.inter.bandwidth) == ("ib", 25e9)
    assert machine.inter.latency == pytest.approx(10e-6)

    plan_path = tmp_path / "p.json"
    code, out, _ = _run(capsys, "plan", MLP, *MLP_SMALL, "-t", str(path), "-s", "megatron", "-o", str(plan_path))
    assert code == 0
    assert "my-box: 4 x A100-80GB (2+2 per node), nvlink 300 GB/s, ib 25 GB/s between nodes" in out
    kinds = {(int(x[0]), int(x[2])): x[3] for x in (ln.split() for ln in out.splitlines() if " -> " in ln[:8])}
    assert kinds and "ib" in kinds.values()
    assert all(kind == ("nvlink" if a // 2 == b // 2 else "ib") for (a, b), kind in kinds.items()), kinds
    assert edatalog.load_plan(plan_path).topology == machine  # the machine travels with the plan


def test_custom_machine_json_numbers_and_defaults(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "jbox.json"
    path.write_text(json.dumps({"nodes": [3], "device": {"memory": 4e10, "flops": "100TFLOPS"}}))
    machine = edatalog.topology(str(path))
    assert machine.name == "jbox" and machine.n == 3  # the name defaults to the file's stem
    assert machine.devices[0].memory == 40 * 10**9 and machine.devices[0].flops == 1e14
    assert machine.inter is None and machine.intra.name == "nvlink"
    code, out, _ = _run(capsys, "plan", MLP, *MLP_SMALL, "-t", str(path), "-s", "data")
    assert code == 0 and "jbox: 3 x GPU (3 per node), nvlink 300 GB/s" in out


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("two.toml", "nodes = [2, 2]\n", "several nodes need [links.inter]"),
        ("broken.toml", "nodes = [2\n", "is not valid TOML"),
        ("broken.json", '{"nodes": [2],', "is not valid JSON"),
        ("list.json", "[1, 2]", "must hold a table"),
        ("unit.toml", 'nodes = [2]\n[device]\nmemory = "lots"\n', "bad device memory: 'lots'"),
        ("rate.toml", 'nodes = [2]\n[links.intra]\nbandwidth = "300Gbps"\n', "bad links.intra.bandwidth"),
        ("zero.toml", "nodes = [0]\n", "'nodes' must be a list of device counts"),
        ("negative.toml", "nodes = [2]\n[device]\nmemory = -5\n", "device memory must be positive"),
        ("links.toml", "nodes = [2]\nlinks = 3\n", "'links' must be a table"),
        ("bandwidth.toml", "nodes = [2]\n[links.intra]\nbandwidth = 0\n", "bandwidth"),
        ("efficiency.toml", 'nodes = [2]\nefficiency = "high"\n', "efficiency"),
        ("efficiency0.toml", "nodes = [2]\nefficiency = 0\n", "efficiency"),
        ("typo.toml", "node = [2, 2]\n", "node"),
    ],
)
def test_bad_machine_files_are_diagnostics(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, text: str, message: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    assert message in _fails(capsys, "plan", MLP, *MLP_SMALL, "-t", str(path))


def test_missing_machine_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = _fails(capsys, "plan", MLP, "-t", str(tmp_path / "nowhere.toml"))
    assert "cannot read topology file" in err


@pytest.mark.parametrize(
    ("name", "suggestion"), [("a100x9", "did you mean 'a100x8'"), ("h100x4x", "did you mean 'h100x4'")]
)
def test_unknown_topology_suggests(capsys: pytest.CaptureFixture[str], name: str, suggestion: str) -> None:
    err = _fails(capsys, "plan", MLP, *MLP_SMALL, "-t", name)
    assert f"unknown topology '{name}'" in err and suggestion in err


def test_unknown_strategy_lists_the_strategies(capsys: pytest.CaptureFixture[str]) -> None:
    err = _fails(capsys, "plan", MLP, *MLP_SMALL, "-s", "megatrn")
    assert "unknown strategy 'megatrn'" in err
    assert "auto, replicate, data, zero, megatron, megatron-sp, megatron-dp, megatron-sp-dp, expert, random" in err
    assert "did you mean 'megatron'" in err


def test_megatron_needs_a_transformer(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    src = tmp_path / "mm.edl"
    src.write_text("dim N = 4.\ninput a[N, N] : f32.\noutput c.\nc[i, j] += a[i, k] * a[k, j].\n")
    assert "needs a transformer" in _fails(capsys, "plan", str(src), "-s", "megatron")


def test_data_strategy_with_the_batch_symbol_twice_in_a_rule(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    src = tmp_path / "seq.edl"
    src.write_text(
        "dim S = 8, D = 16.\ninput x[S, D] : f32.\nparam w[D, D] : f32.\noutput y.\n"
        "q[s, e] += x[s, d] * w[e, d].\nsc[s, t] += q[s, e] * q[t, e] where t <= s.\n"
        "y[s, e] += sc[s, t] * q[t, e].\n"
    )
    code, _, err = _run(capsys, "plan", str(src), "-t", "a100x2", "-s", "data")
    assert code == 0, err


# -- numbers, plan files and explain of what no rule computes ------------------------------------


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--time-limit", "0"], "--time-limit must be a positive number of seconds, not 0"),
        (["--time-limit", "-1"], "--time-limit must be a positive number of seconds, not -1"),
        (["--time-limit", "nan"], "--time-limit must be a positive number of seconds"),
        (["--memory", "-5GB"], "--memory must be positive"),
        (["-m", "-5GB"], "--memory must be positive"),
        (["--memory=-5GB"], "--memory must be positive"),
        (["--memory", "0"], "--memory must be positive"),
        (["--memory", "lots"], "bad --memory: 'lots'"),
    ],
)
def test_plan_numbers_that_no_plan_can_honour(
    capsys: pytest.CaptureFixture[str], option: list[str], message: str
) -> None:
    err = _fails(capsys, "plan", MLP, *MLP_SMALL, "-t", "a100x2", *option)
    assert message in err and "help: " in err


def test_a_plan_file_missing_a_field_names_it(
    capsys: pytest.CaptureFixture[str], gqa_plan: Path, tmp_path: Path
) -> None:
    data = json.loads(gqa_plan.read_text())
    del data["nodes"]
    (tmp_path / "nodes.json").write_text(json.dumps(data))
    for command in (["query"], ["show"], ["explain"]):
        argv = [*command, str(tmp_path / "nodes.json"), *(["q"] if command == ["explain"] else [])]
        argv += ["-o", str(tmp_path / "x.png")] if command == ["show"] else []
        err = _fails(capsys, *argv)
        assert "is not a valid plan: it lacks the field 'nodes' (every rule's tile" in err
        assert "help: a plan file holds format, kind, program" in err and "edl plan FILE -o plan.json" in err
    del data["inputs"]
    (tmp_path / "two.json").write_text(json.dumps(data))
    assert "lacks the fields 'nodes' (" in _fails(capsys, "query", str(tmp_path / "two.json"))
    err = _fails(capsys, "run", LLAMA, *GQA, "--plan", str(tmp_path / "two.json"), "--random", "0")
    assert "'inputs' (where every input and param lives" in err


def test_explain_an_input_or_param_shows_where_it_lives(capsys: pytest.CaptureFixture[str], gqa_plan: Path) -> None:
    code, out, _ = _run(capsys, "explain", str(gqa_plan), "wk")
    assert code == 0
    lines = out.splitlines()
    assert (
        lines[0]
        == "param wk [16, 64] : f32 is placed, not computed: a0:2 d:1 -> devices [{0,1,2,3},{4,5,6,7}] from the start"
    )
    assert "no rule" not in out and "lives at" in lines
    assert lines[-2:] == ["a0 0:8, d 0:64   0,1,2,3", "a0 8:16, d 0:64  4,5,6,7"]
    code, out, _ = _run(capsys, "explain", str(gqa_plan), "x", "--json")
    view = json.loads(out)
    assert code == 0 and view["placement"] == "R" and view["kind"] == "input" and view["computed"] == []
    assert [e["devices"] for e in view["lives"]] == [list(range(8))]
    err = _fails(capsys, "explain", str(gqa_plan), "wkk")  # a mistake suggests relations too
    assert "no relation or rule 'wkk'" in err and "did you mean 'wk'" in err
    code, out, _ = _run(capsys, "explain", str(gqa_plan), "qr#2")  # one rule of a relation
    assert code == 0 and out.startswith("rule qr#2: ")


def test_explain_an_expert_rule_names_the_rows_that_travel(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Under expert parallelism a block over 4 of 8 experts takes a token's row of ``x`` only where
    the token routes there (K=2 choices): 22/28 of the rows, expected."""
    moe = Path(__file__).resolve().parents[2] / "programs" / "moe_layer.edl"
    src = tmp_path / "layer.edl"  # the tokens made on the devices, as inside a model
    src.write_text(moe.read_text().replace("input x[T, D] : f32.", "input x0[T, D] : f32.\nx[t, d] = x0[t, d]."))
    plan = tmp_path / "ep.json"
    dims = ["--dim", "T=16", "--dim", "D=32", "--dim", "F=48"]
    assert _run(capsys, "plan", str(src), *dims, "-s", "expert", "-t", "cpux2", "-o", str(plan))[0] == 0
    code, out, _ = _run(capsys, "explain", str(plan), "h1")
    assert code == 0 and "only the rows routed to a block travel to it (an all-to-all" in out
    assert out.splitlines()[-2].endswith("expected share of the rows: x 79%)")
    code, out, _ = _run(capsys, "explain", str(plan), "h1", "--json")
    chosen = next(p for p in json.loads(out)["h1"] if p["chosen"])
    assert chosen["selective"] == {"x": pytest.approx(22 / 28)}


# -- whole models ------------------------------------------------------------------------------------

MODEL = str(ROOT / "programs" / "llama.edl")
MODEL_DIMS = ["--dim", "S=16", "--dim", "D=32", "--dim", "H=4", "--dim", "KVH=2", "--dim", "F=48", "--dim", "V=40"]


def test_a_model_plan_shows_one_layer_and_composes_its_prediction(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layers tiled as the first are shown once; the prediction is one layer's timeline times
    the layers plus the rest's, the megatron baseline composed alike; the whole model is never
    lowered (that is --full)."""
    from edatalog.plans import Plan

    lowered: list[int] = []
    lowering = Plan.lowering

    def counting(self: Plan, options: Any) -> Any:
        lowered.append(len(self.graph.nodes))
        return lowering(self, options)

    monkeypatch.setattr(Plan, "lowering", counting)
    code, out, _ = _run(capsys, "plan", MODEL, *MODEL_DIMS, "--dim", "L=6", "-t", "a100x4", "--time-limit", "4")
    assert code == 0
    whole = len(edatalog.compile(MODEL, dims=_dims(MODEL_DIMS, L=6)).graph.nodes)
    assert lowered and max(lowered) < whole
    assert "(layers.1 .. layers.5: as layers.0)" in out and "layers.3.q " not in out
    assert "x 6 layers + the rest" in out and "auto / megatron:" in out
    assert out.count("\n") < 120


def test_composed_megatron_is_the_whole_models_megatron() -> None:
    from edatalog.plans import composed_ms

    prog = edatalog.compile(MODEL, dims=_dims(MODEL_DIMS, L=5))
    ms, layer = composed_ms(prog, "a100x4", "megatron")
    whole = edatalog.plan(prog, topology="a100x4", strategy="megatron")
    assert ms == pytest.approx(whole.report.seconds * 1e3, rel=1e-6)
    assert layer.ir.strategy == "megatron" and len(layer.graph.nodes) < len(prog.graph.nodes)


def test_a_model_across_nodes_is_compared_with_pipelines_too(capsys: pytest.CaptureFixture[str]) -> None:
    """On several nodes a model's table has every baseline composed: Megatron inside the nodes
    with data parallelism across, and pipeline stages across, each with its shape."""
    from edatalog.pipelined import pipelined_ms

    code, out, _ = _run(
        capsys, "plan", MODEL, *MODEL_DIMS, "--dim", "L=4", "--dim", "B=2", "-t", "h100x8x2", "--time-limit", "4"
    )
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1]}
    for name in ("megatron-dp", "megatron-sp-dp", "megatron-pp", "megatron-sp-pp"):
        assert name in rows, out
    pipe = pipelined_ms(edatalog.compile(MODEL, dims=_dims(MODEL_DIMS, L=4, B=2)), "h100x8x2", "megatron-pp")
    assert float(rows["megatron-pp"][1]) == pytest.approx(pipe.ms, rel=1e-3)
    assert " ".join(rows["megatron-pp"][3:]) == pipe.shape
    ratio = next(line for line in out.splitlines() if line.startswith("auto / "))
    assert ratio.endswith("(all composed per layer)")


def test_full_times_the_whole_model(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys, "plan", MODEL, *MODEL_DIMS, "--dim", "L=4", "-t", "a100x4", "--time-limit", "3", "--full"
    )
    assert code == 0
    assert "layers.3.q " in out and "predicted" in out and "x 4 layers" not in out


def _dims(flags: list[str], **more: int) -> dict[str, int]:
    pairs = dict(f.split("=") for f in flags[1::2])
    return {**{k: int(v) for k, v in pairs.items()}, **more}
