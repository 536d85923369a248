"""Machines: presets, custom files, units, the cost model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edatalog.errors import EdlError
from edatalog.ir.program import CollectiveKind
from edatalog.solver.costmodel import compute_seconds, port_seconds, transfer_seconds
from edatalog.solver.topology import (
    GIB,
    SHARED_MEMORY_LATENCY,
    Library,
    Topology,
    from_dict,
    load,
    preset,
    quantity,
    resolve,
)


@pytest.mark.parametrize("family", ["a100", "h100", "h200", "pcie4", "cpu"])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_presets_have_the_named_device_count(family: str, n: int) -> None:
    topo = preset(f"{family}x{n}")
    topo.verify()
    assert topo.n == n and len(topo.nodes) == 1


def test_presets_are_what_a_machine_file_writes_and_reads() -> None:
    for name in ("a100x8", "h100x2", "h200x4", "pcie4x4", "cpux2", "2x4"):
        topo = preset(name)
        assert from_dict(json.loads(json.dumps(topo.to_dict())), default_name=name) == topo


def test_two_nodes_of_four() -> None:
    topo = preset("2x4")
    assert topo.nodes == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert topo.link(0, 3).name == "nvlink" and topo.link(0, 4).name == "ib"
    assert topo.link(1, 6).bandwidth == 25e9


@pytest.mark.parametrize(("family", "nic"), [("a100", 25e9), ("h100", 50e9), ("h200", 50e9)])
@pytest.mark.parametrize("nodes", [1, 2, 16, 128])
def test_multi_node_presets_are_nodes_of_eight_with_a_nic_per_gpu(family: str, nic: float, nodes: int) -> None:
    topo = preset(f"{family}x8x{nodes}")
    topo.verify()
    assert topo.n == 8 * nodes and topo.nodes[-1] == tuple(range(8 * nodes - 8, 8 * nodes))
    assert topo.link(0, 7) == preset(f"{family}x8").intra  # inside a node: the one-node preset's NVLink
    if nodes == 1:
        assert topo.inter is None
        return
    assert topo.link(7, 8).name == "ib" and topo.link(7, 8).bandwidth == nic and topo.link(7, 8).latency == 10e-6
    assert from_dict(json.loads(json.dumps(topo.to_dict())), default_name=topo.name) == topo
    if nodes > 2:
        assert f"({nodes} nodes of 8)" in str(topo)


@pytest.mark.parametrize("name", ["h100x8x0", "h100x8x129"])
def test_multi_node_presets_stop_at_128_nodes(name: str) -> None:
    with pytest.raises(EdlError, match=f"unknown topology '{name}'"):
        resolve(name)


def test_unknown_presets_suggest_names() -> None:
    with pytest.raises(EdlError, match="unknown topology 'a100x9'"):
        resolve("a100x9")
    with pytest.raises(EdlError) as info:
        resolve("a10x8")
    assert "a100x8" in str(info.value)
    assert resolve("h100x8x6").n == 48  # any node count up to 128, not only the suggested ones
    with pytest.raises(EdlError) as info:
        resolve("h10x8x16")
    assert "h100x8x16" in str(info.value)


def test_custom_toml_machine(tmp_path: Path) -> None:
    path = tmp_path / "box.toml"
    path.write_text(
        'name = "box"\nnodes = [2, 2]\n[device]\nkind = "L40S"\nmemory = "48GiB"\nflops = "362TFLOPS"\n'
        'bandwidth = "864GB/s"\n[links.intra]\nname = "pcie"\nbandwidth = "32GB/s"\nlatency = "4us"\n'
        '[links.inter]\nbandwidth = "12.5GB/s"\nlatency = "15us"\n'
    )
    topo = load(str(path))
    assert topo.name == "box" and topo.n == 4 and topo.nodes == ((0, 1), (2, 3))
    assert topo.devices[0].memory == 48 * GIB and topo.devices[0].flops == 362e12
    assert topo.link(0, 1).bandwidth == 32e9 and topo.link(0, 1).latency == pytest.approx(4e-6)
    assert topo.link(1, 2).bandwidth == 12.5e9
    assert resolve(str(path)) == topo


def test_a_link_says_how_much_compute_its_transfers_take(tmp_path: Path) -> None:
    path = tmp_path / "cpu.toml"
    path.write_text('nodes = [2]\n[links.intra]\nname = "gloo"\nbandwidth = "2GB/s"\ninterference = 1.0\n')
    topo = load(str(path))
    assert topo.intra.interference == 1.0 and preset("a100x2").intra.interference == 0.2
    ib = preset("2x4").inter
    assert ib is not None and ib.interference == 0.2
    assert preset("cpux2").intra.interference == 0.0
    assert from_dict(json.loads(json.dumps(topo.to_dict()))) == topo
    path.write_text("nodes = [2]\n[links.intra]\ninterference = 1.5\n")
    with pytest.raises(EdlError, match=r"links.intra.interference .* in \[0, 1\], not 1.5"):
        load(str(path))


def test_custom_json_machine_and_mistakes(tmp_path: Path) -> None:
    good = tmp_path / "m.json"
    good.write_text('{"nodes": [3], "device": {"memory": 1e10}}')
    assert load(str(good)).n == 3
    two_nodes = tmp_path / "two.json"
    two_nodes.write_text('{"nodes": [2, 2]}')
    with pytest.raises(EdlError, match=r"links.inter"):
        load(str(two_nodes))
    bad_unit = tmp_path / "bad.json"
    bad_unit.write_text('{"device": {"memory": "80 parsecs"}}')
    with pytest.raises(EdlError, match="bad device memory"):
        load(str(bad_unit))
    broken = tmp_path / "broken.toml"
    broken.write_text("nodes = [")
    with pytest.raises(EdlError, match="not valid TOML"):
        load(str(broken))
    with pytest.raises(EdlError, match="cannot read"):
        load(str(tmp_path / "missing.toml"))


@pytest.mark.parametrize(
    ("text", "unit", "value"),
    [
        ("80GB", "B", 80e9),
        ("80GiB", "B", 80 * GIB),
        ("300GB/s", "B/s", 300e9),
        ("312TFLOPS", "FLOPS", 312e12),
        ("3us", "s", 3e-6),
        ("2ms", "s", 2e-3),
        (5, "B", 5.0),
    ],
)
def test_quantities(text: object, unit: str, value: float) -> None:
    assert quantity(text, unit, "x") == pytest.approx(value)


def test_cost_model() -> None:
    """A big bf16 GEMM on an A100 is compute bound: flops / (0.7 * 312e12); a tiny kernel costs
    the floor; a 72 MB transfer between a pair of A100s takes 3 us + 72e6 / 72e9 = 1.003 ms
    (NCCL's send/recv rate), and holds each end's port for 3 us + 72e6 / 230e9 = 0.316 ms."""
    topo = preset("a100x2")
    dev = topo.devices[0]
    flops = 2 * 4096**3
    assert compute_seconds(flops, 3 * 4096**2 * 2, dev, topo, "bf16") == pytest.approx(flops / (0.7 * 312e12))
    assert compute_seconds(10, 10, dev, topo, "bf16") == topo.kernel_floor
    assert transfer_seconds(72_000_000, topo.link(0, 1)) == pytest.approx(1.003e-3)
    assert port_seconds(72_000_000, topo.link(0, 1)) == pytest.approx(3e-6 + 72e6 / 230e9)


def test_a_link_without_a_pair_rate_moves_one_transfer_at_the_port_rate(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text('nodes = [2]\n[links.intra]\nbandwidth = "10GB/s"\nlatency = 0\n')
    link = load(str(path)).intra
    assert link.p2p_bandwidth is None and link.pair_bandwidth == 10e9
    assert transfer_seconds(10**9, link) == port_seconds(10**9, link) == pytest.approx(0.1)
    path.write_text('nodes = [2]\n[links.intra]\nbandwidth = "10GB/s"\np2p_bandwidth = "2.5GB/s"\nlatency = 0\n')
    link = load(str(path)).intra
    assert transfer_seconds(10**9, link) == pytest.approx(0.4) and port_seconds(10**9, link) == pytest.approx(0.1)
    path.write_text('nodes = [2]\n[links.intra]\np2p_bandwidth = "-1GB/s"\n')
    with pytest.raises(EdlError, match="p2p_bandwidth must be positive"):
        load(str(path))


@pytest.mark.parametrize(
    ("key", "step", "default"),
    [
        # A step of a small all-reduce the runtime runs as pairwise exchanges (gloo, across
        # nodes); without it a step is a message each way.
        ("exchange_latency", "exchange_step_latency", 200e-6),
        # A chunk of an all-reduce among gloo ranks of one node through shared memory.
        ("shared_memory_latency", "shared_memory_step_latency", SHARED_MEMORY_LATENCY),
    ],
)
def test_a_link_may_price_the_runtimes_own_all_reduces(tmp_path: Path, key: str, step: str, default: float) -> None:
    path = tmp_path / "m.toml"
    path.write_text(f'library = "gloo"\nnodes = [2]\n[links.intra]\nlatency = "100us"\n{key} = "250us"\n')
    topo = load(str(path))
    assert getattr(topo.intra, key) == pytest.approx(250e-6) == getattr(topo.intra, step)
    assert from_dict(topo.to_dict()).intra == topo.intra  # as plans carry their machine
    path.write_text('nodes = [2]\n[links.intra]\nlatency = "100us"\n')
    assert getattr(load(str(path)).intra, step) == pytest.approx(default)
    path.write_text(f'nodes = [2]\n[links.intra]\n{key} = "-1us"\n')
    with pytest.raises(EdlError, match=f"{key} must be non-negative"):
        load(str(path))


def test_a_machine_may_say_its_ranks_cannot_share_memory(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text('library = "gloo"\nnodes = [2]\n')
    assert load(str(path)).shared_memory  # the default
    path.write_text('library = "gloo"\nshared_memory = false\nnodes = [2]\n')
    topo = load(str(path))
    assert not topo.shared_memory and from_dict(topo.to_dict()) == topo
    path.write_text('shared_memory = "no"\nnodes = [2]\n')
    with pytest.raises(EdlError, match="shared_memory is true or false"):
        load(str(path))


def test_the_library_decides_which_exchanges_are_collectives(tmp_path: Path) -> None:
    assert preset("a100x8").library is Library.NCCL and preset("cpux2").library is Library.GLOO
    assert Library.NCCL.collectives == set(CollectiveKind)
    assert Library.GLOO.collectives == {CollectiveKind.ALL_REDUCE}
    path = tmp_path / "m.toml"
    path.write_text('library = "gloo"\nnodes = [2]\n')
    assert load(str(path)).library is Library.GLOO
    path.write_text('library = "mpi"\nnodes = [2]\n')
    with pytest.raises(EdlError, match="unknown library 'mpi'"):
        load(str(path))


@pytest.mark.parametrize(
    ("machine", "dtype", "peak"),
    [
        ("a100x2", "bf16", 312e12),
        ("a100x2", "f16", 312e12),
        ("a100x2", "f32", 19.5e12),  # no TF32: what PyTorch's f32 matmuls run at by default
        ("a100x2", "f64", 19.5e12),
        ("h100x2", "bf16", 989e12),
        ("h100x2", "f32", 67e12),
        ("h200x2", "f32", 67e12),
        ("2x4", "f32", 19.5e12),
        ("cpux2", "f32", 1e11),
        ("cpux2", "bf16", 1e11),
    ],
)
def test_kernels_are_costed_at_their_dtypes_peak(machine: str, dtype: str, peak: float) -> None:
    """An f32 GEMM of 4096^3 on an A100: 2 * 4096^3 / (0.7 * 19.5e12) = 10.07 ms, 16x its bf16
    time (0.63 ms): the bytes (3 * 4096^2 * 4 = 201 MB at 0.7 * 2 TB/s = 0.14 ms) do not bind."""
    topo = preset(machine)
    flops, nbytes = 2 * 4096**3, 3 * 4096**2 * 4
    want = max(flops / (0.7 * peak), nbytes / (0.7 * topo.devices[0].bandwidth))
    assert compute_seconds(flops, nbytes, topo.devices[0], topo, dtype) == pytest.approx(want)
    if machine == "a100x2" and dtype == "f32":
        assert want == pytest.approx(10.07e-3, rel=1e-3)


def test_flops_per_dtype_in_a_machine_file(tmp_path: Path) -> None:
    path = tmp_path / "box.toml"
    path.write_text('[device]\nflops = { default = "362TFLOPS", f32 = "91.6TFLOPS" }\n')
    dev = load(str(path)).devices[0]
    assert dev.peak("bf16") == 362e12 and dev.peak("f32") == 91.6e12 and dev.flops == 362e12
    assert from_dict(json.loads(json.dumps(load(str(path)).to_dict()))) == load(str(path))
    path.write_text('[device]\nflops = { f32 = "91.6TFLOPS" }\n')
    with pytest.raises(EdlError, match="needs a 'default' rate"):
        load(str(path))
    path.write_text('[device]\nflops = { default = "1TFLOPS", fp8 = "2TFLOPS" }\n')
    with pytest.raises(EdlError, match="unknown key 'fp8'"):
        load(str(path))


def _device_file(tmp_path: Path, device: str) -> Topology:
    """The topology of a machine file whose ``[device]`` table is ``device``."""
    path = tmp_path / "box.toml"
    path.write_text(f"[device]\n{device}\n")
    return load(str(path))


def test_the_general_bandwidth_in_a_machine_file(tmp_path: Path) -> None:
    """``[device] general_bandwidth``: optional (0, not modeled, on every preset), read and
    written back, never negative."""
    assert all(d.general_bandwidth == 0 for d in preset("a100x8").devices)
    topo = _device_file(tmp_path, 'general_bandwidth = "1.5GB/s"')
    assert {d.general_bandwidth for d in topo.devices} == {1.5e9}
    assert from_dict(json.loads(json.dumps(topo.to_dict()))) == topo
    with pytest.raises(EdlError, match="general_bandwidth must be non-negative"):
        _device_file(tmp_path, "general_bandwidth = -1")


def test_attention_rates_in_a_machine_file(tmp_path: Path) -> None:
    """``[device] attention_flops``: optional, per dtype (a dtype not named runs attention at the
    device's flops), read and written back; an unknown dtype or a negative rate is an error."""
    assert all(d.attention_peaks == () for d in preset("a100x8").devices)
    topo = _device_file(tmp_path, 'flops = "200GFLOPS"\nattention_flops = { bf16 = "80GFLOPS" }')
    assert {d.attention_peak("bf16") for d in topo.devices} == {80e9}
    assert {d.attention_peak("f32") for d in topo.devices} == {200e9}
    assert from_dict(json.loads(json.dumps(topo.to_dict()))) == topo
    with pytest.raises(EdlError, match="unknown key 'int8'"):
        _device_file(tmp_path, 'attention_flops = { int8 = "1TFLOPS" }')
    with pytest.raises(EdlError, match="attention_flops of f32"):
        _device_file(tmp_path, "attention_flops = { f32 = -1 }")
