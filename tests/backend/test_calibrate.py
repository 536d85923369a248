"""``edl calibrate``: measuring the machine and writing it as a machine file.

Only the logic is checked (what is measured, how it becomes a topology, that the file loads),
never how fast this machine is: every timing here is at tiny sizes, on a machine that may be busy.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from pathlib import Path
from typing import Any

import pytest

import edatalog
from edatalog.backend.calibrating import calibrate as cal
from edatalog.backend.calibrating import probe as calibrate_probe
from edatalog.backend.running.compiled import Compile
from edatalog.cli import main
from edatalog.cli.calibrate import attention_probe_graph, class_probe_graphs, general_probe_graph, probe_graphs
from edatalog.errors import EdlError
from edatalog.ir.cost import ONE_ATTENTION, KernelClass, Launches, launches
from edatalog.solver.costmodel import compute_seconds
from edatalog.solver.topology import from_dict

QUICK_KEYS = [cal.shape_key(s) for s in cal.QUICK.matmuls]


def _finite_positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def _check_machine(topo: edatalog.Topology, n: int) -> None:
    assert topo.n == n and topo.name == f"calibrated-cpux{n}"
    assert topo.efficiency == 1.0
    assert _finite_positive(topo.kernel_floor)
    assert _finite_positive(topo.intra.bandwidth) and math.isfinite(topo.intra.latency) and topo.intra.latency >= 0
    for d in topo.devices:
        assert d.kind.startswith("CPU (")
        assert d.memory > 0 and _finite_positive(d.flops) and _finite_positive(d.bandwidth)


def _check_measured(measured: dict[str, Any], ranks: int) -> None:
    assert measured["command"].startswith("edl calibrate --nproc")
    assert measured["date"] and measured["ranks"] == ranks and measured["quick"] is True
    f32 = measured["matmul"]["f32"]
    assert set(QUICK_KEYS) <= set(f32) and "skipped" not in f32
    assert all(_finite_positive(f32[k]) for k in QUICK_KEYS)
    assert set(measured["matmul"]) == set(cal.DTYPES)
    for entry in measured["matmul"].values():  # every dtype: rates, or why it was not measured
        assert any(isinstance(v, float) for v in entry.values()) or "skipped" in entry
    assert sorted(measured["copy"]) == sorted(str(b) for b in cal.QUICK.copy_bytes)
    assert all(_finite_positive(v) for v in measured["copy"].values())
    assert _finite_positive(measured["torch_dispatch"])
    for key in ("flops", "bandwidth", "kernel_floor", "torch_dispatch"):
        assert len(measured["per_rank"][key]) == ranks
        assert all(_finite_positive(v) for v in measured["per_rank"][key])


def test_quick_calibration_in_one_process(tmp_path: Path) -> None:
    seen: list[tuple[float, float, str]] = []
    result = cal.calibrate(cal.Options(nproc=1, quick=True, threads=1), progress=lambda *a: seen.append(a))
    _check_machine(result.topology, 1)
    _check_measured(result.measured, 1)
    assert result.topology.devices[0].kind == "CPU (1 thread)"
    # The device's flops are the median of f32's rates at the block shapes.
    rates = sorted(result.measured["matmul"]["f32"][k] for k in QUICK_KEYS)
    assert rates[0] <= result.topology.devices[0].flops <= rates[-1]
    # No runtime probe given (the command line gives one): the floor is torch's dispatch, and says so.
    assert result.topology.kernel_floor == result.measured["torch_dispatch"]
    assert result.measured["how"]["kernel_floor"].startswith("a 1-element add")

    # Progress: steps counted up to their total, each named.
    assert seen and all(0 <= done <= total for done, total, _ in seen)
    assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)
    assert seen[-1][0] == seen[-1][1] and all(what for _, _, what in seen)

    for name in ("machine.toml", "machine.json"):
        path = tmp_path / name
        result.save(str(path))
        assert edatalog.topology(str(path)) == result.topology
    raw = tomllib.loads((tmp_path / "machine.toml").read_text())
    assert raw["measured"] == result.measured  # every raw number, as measured
    assert json.loads((tmp_path / "machine.json").read_text())["measured"] == result.measured
    text = (tmp_path / "machine.toml").read_text()
    assert text.startswith("# calibrated-cpux1: ") and "# FLOP/s: f32 matmul" in text


def _launches(rules: int) -> int:
    """The kernel launches of the probe's chain of ``rules`` (as the cost model counts them)."""
    graph = edatalog.compile_string(calibrate_probe.source(rules), name="probe").graph
    return sum((launches(node) for node in graph.nodes), Launches()).total


ELEMENTWISE = KernelClass.ELEMENTWISE
PROBE_KERNELS = (_launches(calibrate_probe.RULES), _launches(calibrate_probe.RULES_LONG))


def _rank(flops: float, copy: float, floor: float, links: dict[str, Any], overhead: float = 2e-5) -> dict[str, Any]:
    sizes = cal.QUICK
    matmul = {cal.shape_key(sizes.probe): flops} | dict.fromkeys(QUICK_KEYS, flops)
    device = {
        "matmul": {"f32": matmul, "bf16": {"skipped": "slow"}, "f16": {"skipped": "slow"}, "f64": dict(matmul)},
        "copy": {str(b): copy for b in sizes.copy_bytes},
        "kernel_floor": floor,
        "call_overhead": overhead,
        "torch_dispatch": floor / 50,
        "probe_kernels": list(PROBE_KERNELS),
        "memory": 0,
        "kind": "CPU (1 thread)",
    }
    return {"device": device, "links": links}


def test_the_machine_is_the_slowest_ranks() -> None:
    """From made-up measurements: device rates are the slowest rank's; the link's latency is the
    slowest rank's small message after computing, at least half a small ping-pong; its bandwidth
    the exchange's bytes over its time less the ping-pong's latency."""
    sizes = cal.QUICK
    latency, exchange = 1e-4, 2e-3
    links = {
        "pingpong": {str(b): latency + b / 1e9 for b in sizes.p2p_bytes},
        "exchange": exchange,
        "collective_bytes": 1 << 16,
        "all_reduce": 1e-3,
        "small_all_reduce": 3e-4,
        "small_message": 5e-5,  # less than the idle ping-pong's: the latency stays the ping-pong's
        "small_exchange_all_reduce": 2e-4,
        "small_shared_all_reduce": 5e-5,
        "reduce_scatter": 5e-4,
        "overlap": {"compute": 3e-3, "both": 4e-3},
    }
    slow = dict(
        links,
        exchange=2 * exchange,
        small_all_reduce=5e-4,
        small_exchange_all_reduce=4e-4,
        small_shared_all_reduce=6e-5,
        overlap={"compute": 3.5e-3, "both": 5e-3},
    )
    slower = dict(slow, small_message=3e-4)
    opts = cal.Options(nproc=2, quick=True).resolved()
    result = cal.summarize(opts, {0: _rank(2e10, 1e10, 1e-6, links, 4e-5), 1: _rank(1e10, 2e10, 3e-6, slow)})
    topo = result.topology
    busy = cal.summarize(opts, {0: _rank(2e10, 1e10, 1e-6, links, 4e-5), 1: _rank(1e10, 2e10, 3e-6, slower)})
    assert busy.topology.intra.latency == 3e-4 and busy.measured["p2p"]["latency"] == latency
    assert topo.devices[0].flops == 1e10 and topo.devices[0].bandwidth == 1e10 and topo.kernel_floor == 3e-6
    assert topo.call_overhead == 4e-5  # the slowest rank's too
    assert topo.intra.name == "gloo" and topo.intra.latency == latency
    assert topo.intra.bandwidth == pytest.approx(sizes.exchange_bytes / (2 * exchange - latency), rel=1e-3)
    # Interference from the slowest rank's times: matmuls 3.5 ms alone, the exchange 4 ms alone,
    # both 5 ms: (5 - max(3.5, 4)) / min(3.5, 4) of the shorter did not overlap.
    assert topo.intra.interference == pytest.approx((5 - 4) / 3.5, rel=1e-3)
    # A collective's step: the slowest rank's small all-reduce, less its bytes' time, over the
    # two steps of an all-reduce between two ranks.
    # (With this made-up link's small bandwidth the bytes would take most of it: at most half is
    # credited to them.)
    small_bytes = cal.SMALL_COLLECTIVE_BYTES
    step = max(5e-4 - 2 * small_bytes / topo.intra.bandwidth, 5e-4 / 2) / 2
    assert topo.intra.collective_latency == pytest.approx(step, rel=1e-3)
    assert topo.intra.step_latency == topo.intra.collective_latency
    # As pairwise exchanges (gloo): the slowest rank's, less its bytes each way, over log2 2 steps.
    pairwise = max(4e-4 - 2 * small_bytes / topo.intra.bandwidth, 4e-4 / 2)
    assert topo.intra.exchange_latency == pytest.approx(pairwise, rel=1e-3)
    # Through shared memory: the slowest rank's, less its bytes' memory traffic (5 times them for
    # two ranks, at the slowest device's bandwidth; at most half credited to them).
    shared = max(6e-5 - 5 * small_bytes / topo.devices[0].bandwidth, 6e-5 / 2)
    assert topo.intra.shared_memory_latency == pytest.approx(shared, rel=1e-3)
    m = result.measured
    assert m["per_rank"]["flops"] == [2e10, 1e10]
    assert m["torch_dispatch"] == pytest.approx(3e-6 / 50, rel=1e-3)  # the slowest rank's, as the floor
    assert m["how"]["kernel_floor"] == calibrate_probe.describe(PROBE_KERNELS, Compile.GRAPH)
    assert m["all_reduce"]["busbw"] == pytest.approx((1 << 16) / 1e-3 * 2 * 1 / 2, rel=1e-3)
    assert m["reduce_scatter"]["busbw"] == pytest.approx((1 << 16) / 5e-4 * 1 / 2, rel=1e-3)
    assert m["matmul"]["bf16"] == {"skipped": "slow"}
    assert from_dict(json.loads(json.dumps(result.to_dict()))) == topo


def test_ranks_that_could_not_share_memory_make_a_machine_that_says_so(tmp_path: Path) -> None:
    """Where the ranks could not share memory (gloo), their small all-reduce was timed as pairwise
    exchanges, and the machine says ``shared_memory = false``: the cost model then prices the
    exchanges the runtime runs there."""
    links = {
        "pingpong": {str(b): 1e-4 + b / 1e9 for b in cal.QUICK.p2p_bytes},
        "exchange": 2e-3,
        "collective_bytes": 1 << 16,
        "all_reduce": 1e-3,
        "small_all_reduce": 3e-4,
        "small_message": 5e-5,
        "small_exchange_all_reduce": 2e-4,
        "small_shared_all_reduce": None,
        "shared_memory": False,
        "reduce_scatter": 5e-4,
        "overlap": {"compute": 3e-3, "both": 4e-3},
    }
    opts = cal.Options(nproc=2, quick=True).resolved()
    result = cal.summarize(opts, {0: _rank(2e10, 1e10, 1e-6, links), 1: _rank(2e10, 1e10, 1e-6, links)})
    topo = result.topology
    assert not topo.shared_memory and topo.intra.shared_memory_latency is None
    assert topo.intra.exchange_latency is not None
    path = tmp_path / "m.toml"
    result.save(str(path))
    assert "shared_memory = false" in path.read_text() and edatalog.topology(str(path)) == topo


@pytest.mark.parametrize(
    ("compute", "transfer", "both", "share"),
    [(3.0, 2.0, 3.0, 0.0), (3.0, 2.0, 5.0, 1.0), (3.0, 2.0, 4.0, 0.5), (2.0, 3.0, 2.5, 0.0), (2.0, 2.0, 9.0, 1.0)],
)
def test_interference_is_the_share_of_the_shorter_that_did_not_overlap(
    compute: float, transfer: float, both: float, share: float
) -> None:
    # (both - max(compute, transfer)) / min(compute, transfer), clipped to [0, 1].
    assert cal.interference_of(compute, transfer, both) == pytest.approx(share)


def test_the_kernel_floor_is_a_rule_run_by_the_runtime() -> None:
    """The floor is what a small rule's launch costs in edatalog's torch runtime (the probes the command
    line compiles, run as a plan's programs are, in the mode asked for), with torch's dispatch of a
    1-element add measured beside it.  Without a probe, the floor is that add and there is no
    overhead.  (How the modes compare, tens of µs interpreted against a few replayed as a graph,
    is a timing: `edl calibrate`'s output and docs/benchmarks.md show it; a test under a loaded
    machine cannot rely on it.)"""
    import torch

    opts = cal.Options(nproc=1, threads=1, quick=True, probe=probe_graphs(), compile="none").resolved()
    cpu = torch.device("cpu")
    interpreted = cal.measure_floor(opts, cal.QUICK, cpu, lambda: None)
    assert interpreted["probe_kernels"] == list(PROBE_KERNELS)
    assert _finite_positive(interpreted["torch_dispatch"]) and _finite_positive(interpreted["kernel_floor"])
    assert len(interpreted["probe_seconds"]) == 2 and all(map(_finite_positive, interpreted["probe_seconds"]))
    graph = cal.measure_floor(dataclasses.replace(opts, compile="graph"), cal.QUICK, cpu, lambda: None)
    assert graph["probe_kernels"] == list(PROBE_KERNELS)
    assert _finite_positive(graph["kernel_floor"]) and graph["call_overhead"] >= 0
    plain = cal.measure_floor(dataclasses.replace(opts, probe=None), cal.QUICK, cpu, lambda: None)
    assert plain["probe_kernels"] == [] and plain["kernel_floor"] == plain["torch_dispatch"]
    assert plain["call_overhead"] == 0


@pytest.mark.parametrize(
    ("seconds", "kernels", "floor", "overhead"),
    [
        ((100e-6, 280e-6), (16, 64), 3.75e-6, 40e-6),  # slope, and what the short chain leaves
        ((100e-6, 90e-6), (16, 64), 90e-6 / 64, 100e-6 - 16 * 90e-6 / 64),  # noise: the long chain's share
        ((10e-6, 256e-6), (16, 64), 246e-6 / 48, 0.0),  # the short chain under its kernels' share: none
    ],
)
def test_floor_and_overhead_from_two_chains(
    seconds: tuple[float, float], kernels: tuple[int, int], floor: float, overhead: float
) -> None:
    got_floor, got_overhead = calibrate_probe.floor_and_overhead(seconds, kernels)
    assert got_floor == pytest.approx(floor) and got_overhead == pytest.approx(overhead, abs=1e-12)


def test_each_class_probe_adds_kernels_of_its_class() -> None:
    """A class's longer chain launches more kernels of that class, one per link, as lowered
    (the attention chain fused into one kernel per link); the reduction's links also scale by
    their sums (an elementwise kernel each), nothing else."""
    import torch

    short, long = calibrate_probe.CLASS_LINKS
    for name, small, large in class_probe_graphs():
        cls = KernelClass(name)
        got = [calibrate_probe.runner(g, torch.device("cpu"), Compile.GRAPH)[1] for g in (small, large)]
        more = {c: n - dict(got[0].items()).get(c, 0) for c, n in got[1].items()}
        want = {cls: long - short} | ({KernelClass.ELEMENTWISE: long - short} if cls is KernelClass.REDUCTION else {})
        assert {c: n for c, n in more.items() if n} == want, cls


@pytest.mark.parametrize(
    ("cls", "seconds", "launches", "known", "floor"),
    [
        # 24 more elementwise kernels in 36 µs more: 1.5 µs each
        (KernelClass.ELEMENTWISE, (20e-6, 56e-6), (Launches(9), Launches(33)), {}, 1.5e-6),
        # 24 more reductions and 24 more elementwise at 1.5 µs: the rest per reduction
        (
            KernelClass.REDUCTION,
            (50e-6, 170e-6),
            (Launches(9, 8), Launches(33, 32)),
            {KernelClass.ELEMENTWISE: 1.5e-6},
            3.5e-6,
        ),
        # an elementwise floor not measured yet: the fallback (2 µs) prices them
        (KernelClass.REDUCTION, (50e-6, 170e-6), (Launches(9, 8), Launches(33, 32)), {}, 3e-6),
        # noise larger than the difference: the longer chain's time per kernel
        (KernelClass.GEMM, (60e-6, 50e-6), (Launches(1, 0, 8), Launches(1, 0, 32)), {}, 50e-6 / 33),
    ],
)
def test_a_class_floor_from_two_chains(
    cls: KernelClass,
    seconds: tuple[float, float],
    launches: tuple[Launches, Launches],
    known: dict[KernelClass, float],
    floor: float,
) -> None:
    assert calibrate_probe.class_floor(cls, seconds, launches, known, 2e-6) == pytest.approx(floor)
    with pytest.raises(ValueError, match="must launch more"):
        calibrate_probe.class_floor(cls, seconds, (launches[1], launches[0]), known, 2e-6)


def test_every_class_floor_is_measured() -> None:
    import torch

    opts = cal.Options(nproc=1, threads=1, quick=True, probe=probe_graphs(), class_probes=class_probe_graphs())
    floors = cal.measure_floor(opts.resolved(), cal.QUICK, torch.device("cpu"), lambda: None)["kernel_floors"]
    assert sorted(floors) == sorted(c.value for c in KernelClass)
    assert all(_finite_positive(f) for f in floors.values())


@pytest.mark.distributed
def test_two_ranks_measure_their_links(tmp_path: Path) -> None:
    seen: list[tuple[float, float, str]] = []
    opts = cal.Options(nproc=2, quick=True, probe=probe_graphs(), class_probes=class_probe_graphs())
    result = cal.calibrate(opts, progress=lambda *a: seen.append(a))
    topo = result.topology
    _check_machine(topo, 2)
    _check_measured(result.measured, 2)
    # Each rank ran the runtime probe, at once: the floor is the slower rank's time per kernel op.
    per_rank = result.measured["per_rank"]
    assert topo.kernel_floor == max(per_rank["kernel_floor"])
    assert topo.call_overhead == max(per_rank["call_overhead"])
    assert "the ranks leave a barrier together" in result.measured["how"]["call_overhead"]  # as each rank runs its part
    assert all(v >= 0 for v in per_rank["device_call_overhead"])  # one device's, which prices the general probe
    assert [c for c, _ in topo.kernel_floors] == list(KernelClass)
    assert all(f == max(per_rank["kernel_floors"][c.value]) for c, f in topo.kernel_floors)
    assert all(len(chains) == 2 and all(t > 0 for t in chains) for chains in per_rank["probe_seconds"])
    assert topo.devices[0].kind == "CPU (1 thread)"  # one thread per rank by default
    assert topo.intra.name == "gloo" and topo.intra.latency > 0
    m = result.measured
    assert m["backend"] == "gloo" and m["threads"] == 1
    assert sorted(m["p2p"]["one_way"], key=int) == [str(b) for b in cal.QUICK.p2p_bytes]
    # The link's latency is a message as programs meet them, right after computing: no less than
    # the idle ping-pong's (kept in [measured.p2p]).
    assert topo.intra.latency == max(m["p2p"]["latency"], m["small_message"]["seconds"])
    assert m["exchange"]["bandwidth"] == topo.intra.bandwidth
    assert 0 <= topo.intra.interference <= 1 and m["overlap"]["interference"] == topo.intra.interference
    for op in ("all_reduce", "reduce_scatter"):
        assert _finite_positive(m[op]["seconds"]) and _finite_positive(m[op]["busbw"])
    # The small all-reduce also as the runtime runs it between gloo ranks of one machine: through
    # shared memory.
    assert "small_exchange_all_reduce" not in m and topo.intra.exchange_latency is None
    assert _finite_positive(m["small_shared_all_reduce"]["seconds"])
    assert topo.intra.shared_memory_latency is not None and topo.intra.shared_memory_latency > 0
    assert seen and seen[-1][0] == seen[-1][1]  # rank 0's progress reached this process
    path = tmp_path / "cpu2.toml"
    result.save(str(path))
    assert edatalog.topology(str(path)) == topo


# -- the command line -------------------------------------------------------------------------------


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["calibrate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_writes_a_machine_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "machine.toml"
    code, out, err = _run(capsys, "--nproc", "1", "--threads", "1", "--quick", "-o", str(path))
    assert code == 0, err
    topo = edatalog.topology(str(path))
    _check_machine(topo, 1)
    lines = out.splitlines()
    assert lines[0].startswith("1 rank x 1 thread on cpu")
    header = next(line for line in lines if line.startswith("measured"))
    assert header.split() == ["measured", "value", "note"]
    assert any(line.startswith("matmul f32 ") and "FLOP/s" in line for line in lines)
    floor_row = next(line for line in lines if line.startswith("kernel floor"))
    assert "small rules run by edatalog's torch runtime (graph), per launch -> kernel_floor" in floor_row
    assert any(line.startswith("call overhead") and "-> call_overhead" in line for line in lines)
    for cls in KernelClass:  # a floor per kernel class
        assert any(line.startswith(f"{cls} floor") and f"-> kernel_floors.{cls}" in line for line in lines)
    assert [c for c, _ in topo.kernel_floors] == list(KernelClass)
    assert any(line.startswith("torch dispatch") for line in lines)
    assert str(topo) in lines
    measured = tomllib.loads(path.read_text())["measured"]  # the command line probes the runtime
    assert measured["how"]["kernel_floor"] == calibrate_probe.describe(PROBE_KERNELS, Compile.GRAPH)
    assert measured["compile"] == "graph"
    assert f"wrote {path}: use it with --topology {path}" in out

    code, out, err = _run(capsys, "--nproc", "1", "--threads", "1", "--quick", "--json")
    assert code == 0
    doc = json.loads(out)
    assert sorted(doc) == ["measured", "output", "topology"] and doc["output"] is None
    _check_measured(doc["measured"], 1)
    assert from_dict(doc["topology"]).n == 1
    assert "nothing written" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc", "0"], "--nproc must be at least 1, not 0"),
        (["--nproc", "1", "--threads", "0"], "--threads must be at least 1, not 0"),
        (["--quick", "-o", "no/such/dir/machine.toml"], "the directory no/such/dir does not exist"),
        (["--quick", "-o", "machine.txt"], "its name must end in .toml or .json"),
    ],
)
def test_cli_mistakes_are_errors(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == 1 and not out
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_cli_output_must_not_be_a_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "d.toml").mkdir()
    code, _, err = _run(capsys, "--quick", "-o", str(tmp_path / "d.toml"))
    assert code == 1 and "it is a directory" in err


def test_cli_cuda_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = _run(capsys, "--device", "cuda", "--quick")
    assert code == 1 and "no CUDA device" in err and "help: " in err


def test_cli_help_teaches() -> None:
    with pytest.raises(SystemExit) as info:
        main(["calibrate", "--help"])
    assert info.value.code == 0


# -- the machine file format -----------------------------------------------------------------------


def test_topology_files_accept_a_measured_table(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text('name = "m"\n[device]\nflops = 1e12\n[measured]\nanything = [1, 2]\n[measured.deeper]\nx = "y"\n')
    assert edatalog.topology(str(path)).devices[0].flops == 1e12
    with pytest.raises(EdlError, match="'measured' must be a table"):
        from_dict({"measured": 3})
    with pytest.raises(EdlError, match="unknown key 'measure'") as info:
        from_dict({"measure": {}})
    assert "measured" in str(info.value)


def test_the_general_bandwidth_is_the_probes_time_beyond_its_roofline() -> None:
    """From made-up probe times: the probe (causal scores, then their row maxima on the general
    path) took 1.2 ms; its kernels cost, by the roofline on 1e10 FLOP/s and 1e10 B/s with a
    3 µs floor per launch, max(2 x 3 µs, 1e6 / 1e10) = 100 µs and max(3 µs, 1.1e6 / 1e10) = 110 µs,
    and the call 20 µs more; the rest, 1.2 - 0.23 = 0.97 ms, is the maxima's 1.1 MB on the
    general path: 1.1e6 / 0.97e-3 B/s."""
    rank = _rank(1e10, 1e10, 3e-6, {}, overhead=20e-6)
    kernels = [[512, 1_000_000, False, 2], [512, 1_100_000, True, 1]]
    rank["device"]["general"] = {"seconds": 1.2e-3, "kernels": kernels}
    result = cal.summarize(cal.Options(nproc=1, quick=True).resolved(), {0: rank})
    assert result.topology.devices[0].general_bandwidth == pytest.approx(1.1e6 / (1.2e-3 - 230e-6), rel=1e-3)
    assert result.measured["general"]["roofline_seconds"] == pytest.approx(230e-6, rel=1e-3)
    # Loaded back from the machine file's dict, the field is kept.
    assert from_dict(json.loads(json.dumps(result.to_dict()))).devices[0].general_bandwidth > 0


def test_the_general_probe_runs_on_the_general_path() -> None:
    """The command line's general probe compiles, its maxima take the runtime's general path,
    and measuring it gives a time and its kernels' costs."""
    import torch

    opts = cal.Options(nproc=1, threads=1, quick=True, probe=probe_graphs(), general_probe=general_probe_graph())
    probed = cal.measure_floor(opts.resolved(), cal.QUICK, torch.device("cpu"), lambda: None)
    assert _finite_positive(probed["general"]["seconds"])
    assert [general for *_, general, _ in probed["general"]["kernels"]] == [False, True]


def test_probes_run_in_the_mode_plans_will_run_in() -> None:
    """auto resolves as the runtime resolves it: graph off a GPU and for ranks of a job;
    cudagraph for one process on one GPU; cudagraph for ranks is an error that says why."""
    assert cal.runtime_mode(cal.Options(nproc=1, device="cpu")) is Compile.GRAPH
    assert cal.runtime_mode(cal.Options(nproc=2, device="cpu", compile="none")) is Compile.NONE
    with pytest.raises(EdlError, match="ranks of a job replay their segments as graphs"):
        cal.runtime_mode(cal.Options(nproc=2, device="cpu", compile="cudagraph"))


@pytest.mark.gpu
def test_one_gpu_calibrates_cuda_graph_replay() -> None:
    assert cal.runtime_mode(cal.Options(nproc=1, device="cuda")) is Compile.CUDAGRAPH
    assert cal.runtime_mode(cal.Options(nproc=2, device="cuda")) is Compile.GRAPH


def test_the_attention_rate_is_the_probes_flops_over_its_time_beyond_the_call() -> None:
    """From a made-up probe time: 1e8 FLOPs (as the cost model counts the fused kernel's) in
    1.02 ms, of which the call 20 µs: 1e11 FLOP/s, for the programs' dtype only; written to the
    machine file and loaded back; a fused attention on the machine then takes that long."""
    rank = _rank(4e11, 1e10, 3e-6, {}, overhead=20e-6)
    rank["device"]["attention"] = {"seconds": 1.02e-3, "flops": 10**8}
    result = cal.summarize(cal.Options(nproc=1, quick=True).resolved(), {0: rank})
    device = result.topology.devices[0]
    assert [k for k, _ in device.attention_peaks] == ["f32"]
    assert device.attention_peak("f32") == pytest.approx(1e11)
    assert device.attention_peak("bf16") == device.flops
    assert "attention_flops = { f32 = " in result.toml()
    assert from_dict(json.loads(json.dumps(result.to_dict()))).devices[0].attention_peaks == device.attention_peaks
    seconds = compute_seconds(10**8, 0, device, result.topology, "f32", launches=ONE_ATTENTION)
    assert seconds == pytest.approx(1e-3, rel=1e-3)


def test_the_attention_probe_runs_as_one_fused_kernel() -> None:
    """The command line's attention probe compiles in each dtype, runs as one fused attention,
    and measuring it gives a time and the kernel's FLOPs over the flash tiles."""
    import torch

    for dtype in ("f32", "bf16"):
        probe = attention_probe_graph("cpu", True, dtype)
        opts = cal.Options(nproc=1, threads=1, quick=True, probe=probe_graphs(), attention_probe=probe, dtype=dtype)
        probed = cal.measure_floor(opts.resolved(), cal.QUICK, torch.device("cpu"), lambda: None)
        rows, heads, width = cal.QUICK.attention
        assert _finite_positive(probed["attention"]["seconds"])
        # Five rules' FLOPs over the causal tiles of one 128-row tile: at least the full scores.
        assert probed["attention"]["flops"] >= 2 * heads * rows * rows * width
