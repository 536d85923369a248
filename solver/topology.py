"""Machines: devices (memory, peak FLOP/s, memory bandwidth) and the links between them.

Devices sit in nodes.  Devices of one node talk over the node's links (NVLink/NVSwitch, PCIe);
devices of different nodes over the inter-node links (InfiniBand).  Every link class is modelled
per device port: a transfer from ``a`` to ``b`` uses ``a``'s egress and ``b``'s ingress port of
that class, at the class's bandwidth, after its latency.  A link class also says how much of a
transfer's time the devices at its ends lose from computing (``interference``): none where a DMA
engine or a NIC moves the bytes, all of it where the cores that compute copy them too (gloo
between CPU processes, as ``edl calibrate`` measures).

Presets carry the device count in their name (``a100x8``, ``h200x4``, ``cpux2``, ``2x4``, and
``h100x8x16`` for 16 nodes of 8); custom
machines are small TOML or JSON files (see ``docs/plans.md``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from edatalog.errors import EdlError, did_you_mean
from edatalog.ir.cost import KernelClass, Launches
from edatalog.ir.program import CollectiveKind

GIB = 1 << 30
# Seconds a chunk of a shared-memory all-reduce costs where no calibration measured it: what
# edatalog's runtime took for 4 KiB between 2 CPU ranks of a 2-core VM (7-26 µs), rounded up.
SHARED_MEMORY_LATENCY = 20e-6


class Library(StrEnum):
    """The torch.distributed backend that moves data between a machine's devices."""

    NCCL = "nccl"
    GLOO = "gloo"

    @property
    def collectives(self) -> frozenset[CollectiveKind]:
        """The exchanges it runs faster as one collective than as direct messages: every kind on
        NCCL; on gloo only the all-reduce (2 CPU ranks, measured side by side: its all_reduce
        beat direct messages, its reduce_scatter and all_gather did not; see
        :mod:`edatalog.backend.lowering.collectives`)."""
        if self is Library.NCCL:
            return frozenset(CollectiveKind)
        return frozenset({CollectiveKind.ALL_REDUCE})


@dataclass(frozen=True)
class Device:
    index: int
    node: int
    kind: str  # "A100-80GB", "H100", "CPU", ...
    memory: int  # bytes
    flops: float  # peak FLOP/s of a kernel in a dtype ``peaks`` does not name
    bandwidth: float  # memory bandwidth, bytes/s
    # Peak FLOP/s per dtype where it differs (an A100: bf16 312 TF, but f32 19.5 TF), sorted.
    peaks: tuple[tuple[str, float], ...] = ()
    # Streaming multiprocessors: a GEMM runs in waves of one output tile per SM, so a GEMM whose
    # tiles leave the last wave part empty wastes the rest (0: no such quantization, e.g. CPUs).
    sms: int = 0
    # Bytes/s at which the runtime's general evaluator (blocks no prepared torch call covers:
    # guarded sums cut by their guard, maxima, gathers) passes over a block's arrays, on top of
    # the roofline: it builds masks and makes several passes.  Measured by ``edl calibrate``;
    # 0: not modeled (the presets: no GPU measured it).
    general_bandwidth: float = 0.0
    # FLOP/s a fused attention kernel reaches per dtype, where measured (``edl calibrate``: a
    # CPU's flash kernel runs far below its GEMMs), sorted; a dtype not listed runs at its peak.
    attention_peaks: tuple[tuple[str, float], ...] = ()

    def peak(self, dtype: str) -> float:
        """The peak FLOP/s of kernels computing in ``dtype``."""
        for name, rate in self.peaks:
            if name == dtype:
                return rate
        return self.flops

    def attention_peak(self, dtype: str) -> float:
        """The FLOP/s of a fused attention kernel computing in ``dtype`` (its FLOPs counted over
        the flash tiles it computes)."""
        rate = dict(self.attention_peaks).get(dtype)
        return self.peak(dtype) if rate is None else rate

    def flops_spec(self) -> float | dict[str, float]:
        """``flops`` as a machine file writes it: one number, or a rate per dtype."""
        return {"default": self.flops, **dict(self.peaks)} if self.peaks else self.flops

    def __str__(self) -> str:
        return f"{self.index}"


@dataclass(frozen=True)
class Link:
    """A link class.  ``bandwidth`` is what a device's port of this class carries per direction,
    all its transfers together; a collective over it moves at that rate (NCCL's "bus
    bandwidth").  One point-to-point transfer between a pair moves at ``p2p_bandwidth`` at most
    (NCCL's send/recv between two A100s runs at a fraction of what its rings reach): a device
    reaches its port's rate only by sending to several peers at once."""

    name: str  # "nvlink", "pcie", "ib", ...
    bandwidth: float  # bytes/s per direction per device
    latency: float  # seconds
    # The fraction of a transfer's time each end's compute engine loses to it, in [0, 1].
    interference: float = 0.0
    p2p_bandwidth: float | None = None  # bytes/s of one transfer between a pair; None: ``bandwidth``
    # Seconds per step of a collective (a hop of a ring or a tree level) where the library's
    # collectives cost more than its point-to-point latency (gloo's all-reduce of a few bytes
    # takes several round trips); None: ``latency``.  ``edl calibrate`` measures it.
    collective_latency: float | None = None
    # Seconds per step of a small all-reduce the runtime runs as pairwise exchanges (on gloo:
    # :func:`edatalog.solver.costmodel.all_reduce_route`), as programs meet it, less
    # its bytes' time; None: ``latency`` twice (a step is a message each way, one after the
    # other).  ``edl calibrate`` measures it.
    exchange_latency: float | None = None
    # Seconds per chunk of an all-reduce among the CPU ranks of one node through shared memory
    # (:func:`edatalog.solver.costmodel.all_reduce_route`), as the runtime runs it, less its
    # bytes' time; None: :data:`SHARED_MEMORY_LATENCY`.  ``edl calibrate`` measures it.
    shared_memory_latency: float | None = None

    @property
    def shared_memory_step_latency(self) -> float:
        """The latency of one chunk of an all-reduce through shared memory."""
        return SHARED_MEMORY_LATENCY if self.shared_memory_latency is None else self.shared_memory_latency

    @property
    def exchange_step_latency(self) -> float:
        """The latency of one step of an all-reduce run as pairwise exchanges."""
        return 2 * self.latency if self.exchange_latency is None else self.exchange_latency

    @property
    def step_latency(self) -> float:
        """The latency of one step of a collective."""
        return self.latency if self.collective_latency is None else self.collective_latency

    @property
    def pair_bandwidth(self) -> float:
        """The most bytes/s one point-to-point transfer moves."""
        return self.bandwidth if self.p2p_bandwidth is None else min(self.p2p_bandwidth, self.bandwidth)

    def to_dict(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"interference": self.interference} if self.interference else {}
        if self.p2p_bandwidth is not None:
            extra["p2p_bandwidth"] = self.p2p_bandwidth
        if self.collective_latency is not None:
            extra["collective_latency"] = self.collective_latency
        if self.exchange_latency is not None:
            extra["exchange_latency"] = self.exchange_latency
        if self.shared_memory_latency is not None:
            extra["shared_memory_latency"] = self.shared_memory_latency
        return {"name": self.name, "bandwidth": self.bandwidth, "latency": self.latency, **extra}


@dataclass(frozen=True)
class Topology:
    name: str
    devices: tuple[Device, ...]
    intra: Link  # between devices of one node
    inter: Link | None = None  # between nodes; None for single-node machines
    efficiency: float = 0.7  # fraction of peak FLOP/s and HBM bandwidth kernels reach
    kernel_floor: float = 5e-6  # seconds: the least a kernel launch costs
    # The communication library the runtime uses between these devices (torch.distributed's
    # backend): which exchanges run as one collective depends on it.
    library: Library = Library.NCCL
    # Seconds a call of a device's program costs beyond its ops: the runtime taking the inputs
    # and handing out the outputs (``edl calibrate`` measures it; 0: not modeled).
    call_overhead: float = 0.0
    # Seconds a small kernel of a class costs, where measured (``edl calibrate``); a class not
    # listed costs ``kernel_floor``.  Sorted by class.
    kernel_floors: tuple[tuple[KernelClass, float], ...] = ()
    # Whether gloo's ranks of one node all-reduce through shared memory (the runtime can where
    # the node is x86-64 with ``/dev/shm``; ``edl calibrate`` writes false where it could not).
    shared_memory: bool = True

    def floor(self, cls: KernelClass) -> float:
        """The least one kernel of class ``cls`` costs."""
        return self._floors.get(cls, self.kernel_floor)

    def launch_seconds(self, launches: Launches | int) -> float:
        """The least a kernel making ``launches`` costs: each launch its class's floor (a bare
        count: ``kernel_floor`` each)."""
        if isinstance(launches, int) or not self.kernel_floors:
            return self.kernel_floor * (launches if isinstance(launches, int) else launches.total)
        return sum(self.floor(cls) * count for cls, count in launches.items())

    @functools.cached_property
    def _floors(self) -> dict[KernelClass, float]:  # the solver prices every block's launches
        return dict(self.kernel_floors)

    @property
    def n(self) -> int:
        return len(self.devices)

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        """Device indices grouped by node."""
        groups: dict[int, list[int]] = {}
        for d in self.devices:
            groups.setdefault(d.node, []).append(d.index)
        return tuple(tuple(g) for _, g in sorted(groups.items()))

    def with_memory(self, nbytes: int) -> Topology:
        """The same machine with ``nbytes`` of memory on every device (e.g. one layer's share)."""
        if nbytes <= 0:
            raise EdlError(f"memory per device must be positive, not {nbytes}")
        devices = tuple(dataclasses.replace(d, memory=nbytes) for d in self.devices)
        return dataclasses.replace(self, devices=devices)

    def subset(self, devices: Sequence[int]) -> Topology:
        """These devices alone (one pipeline stage's), numbered from 0 in this order."""
        picked = tuple(dataclasses.replace(self.devices[d], index=k) for k, d in enumerate(devices))
        nodes = {d.node for d in picked}
        return dataclasses.replace(
            self,
            name=f"{self.name}[{devices[0]}..{devices[-1]}]",
            devices=picked,
            inter=self.inter if len(nodes) > 1 else None,
        )

    def link(self, a: int, b: int) -> Link:
        if self.devices[a].node == self.devices[b].node or self.inter is None:
            return self.intra
        return self.inter

    def verify(self) -> None:
        assert self.devices, "a topology has at least one device"
        assert [d.index for d in self.devices] == list(range(self.n)), "devices are numbered 0..n-1"
        assert len(self.nodes) == 1 or self.inter is not None, "several nodes need inter-node links"

    def __str__(self) -> str:
        kinds = sorted({d.kind for d in self.devices})
        sizes = {len(g) for g in self.nodes}
        if len(self.nodes) > 2 and len(sizes) == 1:
            per_node = f"{len(self.nodes)} nodes of {sizes.pop()}"
        else:
            per_node = "+".join(str(len(g)) for g in self.nodes) + " per node"
        text = f"{self.name}: {self.n} x {'/'.join(kinds)} ({per_node}), {_link(self.intra)}"
        if self.inter is not None and len(self.nodes) > 1:
            text += f", {_link(self.inter)} between nodes"
        return text

    def to_dict(self) -> dict[str, Any]:
        d0 = self.devices[0]
        return {
            "name": self.name,
            "nodes": [len(g) for g in self.nodes],
            "device": {
                "kind": d0.kind,
                "memory": d0.memory,
                "flops": d0.flops_spec(),
                "bandwidth": d0.bandwidth,
                **({"sms": d0.sms} if d0.sms else {}),
                **({"general_bandwidth": d0.general_bandwidth} if d0.general_bandwidth else {}),
                **({"attention_flops": dict(d0.attention_peaks)} if d0.attention_peaks else {}),
            },
            "links": {
                "intra": self.intra.to_dict(),
                **({"inter": self.inter.to_dict()} if self.inter is not None else {}),
            },
            "efficiency": self.efficiency,
            "kernel_floor": self.kernel_floor,
            **({"call_overhead": self.call_overhead} if self.call_overhead else {}),
            **({"kernel_floors": {c.value: f for c, f in self.kernel_floors}} if self.kernel_floors else {}),
            "library": self.library.value,
            **({} if self.shared_memory else {"shared_memory": False}),
        }


def _rate(bps: float) -> str:
    return f"{bps / 1e9:g} GB/s"


def _link(link: Link) -> str:
    pair = "" if link.pair_bandwidth == link.bandwidth else f" ({_rate(link.pair_bandwidth)} per pair)"
    return f"{link.name} {_rate(link.bandwidth)}{pair}"


# -- presets ------------------------------------------------------------------------------------

_GPUS = {
    # kind: (memory, bf16/f16 dense FLOP/s, HBM bytes/s, SMs)
    "a100": ("A100-80GB", 80 * GIB, 312e12, 2.0e12, 108),
    "h100": ("H100", 80 * GIB, 989e12, 3.35e12, 132),
    "h200": ("H200", 141 * 10**9, 989e12, 4.8e12, 132),
}
# NVLink per GPU and direction, as NCCL reaches it, not the data sheet's 300 (A100) or 450 GB/s
# (H100/H200): on 8 x A100 its all-reduce measures 208-230 GB/s of bus bandwidth and a send/recv
# between a pair about 72 GB/s (the measurements the audit of issue 11 cites; not ours).  The
# H100/H200 figures scale the A100's fractions (0.77 and 0.24 of the data sheet) to 450 GB/s: an
# assumption until measured.
_NVLINK = {
    "a100": (230e9, 72e9),  # (port/collective, one pair point-to-point)
    "h100": (345e9, 108e9),
    "h200": (345e9, 108e9),
}
# Dense peaks of the dtypes whose kernels do not run at the bf16/f16 tensor-core rate (NVIDIA's
# data sheets, SXM parts): f32 without TF32 (PyTorch's default for f32 matmuls), and f64 on the
# FP64 tensor cores.  Integer and bool rules are elementwise, bound by bandwidth.
_SLOW_PEAKS = {
    "a100": (("f32", 19.5e12), ("f64", 19.5e12)),
    "h100": (("f32", 67e12), ("f64", 67e12)),
    "h200": (("f32", 67e12), ("f64", 67e12)),
}
NVLINK_LATENCY = 3e-6
# The share of a GPU transfer's time that the GPUs at its ends lose from computing: NCCL moves
# bytes with kernels on the SMs and through the same HBM, and GEMMs overlapped with it are
# typically 10-30% slower; the presets take the middle, an assumption, not a measurement (a
# machine file sets its own, and `edl calibrate` measures it).
GPU_INTERFERENCE = 0.2
PCIE4 = Link("pcie4", 25e9, 5e-6, GPU_INTERFERENCE)
INFINIBAND = Link("ib", 25e9, 10e-6, GPU_INTERFERENCE)
# Between the nodes of a multi-node preset, each GPU has its own InfiniBand NIC (NVIDIA's DGX
# A100: eight 200 Gb/s HDR ConnectX-6; DGX H100 and H200: eight 400 Gb/s NDR ConnectX-7), so a
# GPU's port to other nodes is its NIC's line rate per direction: 25 and 50 GB/s.  A step of a
# collective across nodes takes 10 us: NCCL's tuning model (src/graph/tuning.cc) charges a
# network ring step 6.6-9.6 us and a network tree step up to 50 us (Simple protocol), against
# 3.4-5.7 us for an NVLink ring step.
_IB = {"a100": 25e9, "h100": 50e9, "h200": 50e9}
IB_LATENCY = 10e-6
NODE_GPUS = 8  # GPUs per node of the multi-node presets
MOST_NODES = 128
PRESETS_HELP = (
    f"a100xN, h100xN, h200xN, pcie4xN, cpuxN (N = 1..8), a100x8xM, h100x8xM, h200x8xM "
    f"(M = 1..{MOST_NODES} nodes of 8), or 2x4"
)


Peaks = tuple[tuple[str, float], ...]


def _nvlink(family: str) -> Link:
    port, pair = _NVLINK[family]
    return Link("nvlink", port, NVLINK_LATENCY, GPU_INTERFERENCE, pair)


def _gpus(family: str, n: int, node_size: int | None = None) -> tuple[Device, ...]:
    kind, mem, flops, bw, sms = _GPUS[family]
    per = node_size or n
    return tuple(Device(i, i // per, kind, mem, flops, bw, _SLOW_PEAKS[family], sms) for i in range(n))


def _ib(family: str) -> Link:
    return Link("ib", _IB[family], IB_LATENCY, GPU_INTERFERENCE)


def preset(name: str) -> Topology:
    """A named machine: ``a100x8``, ``h200x4``, ``pcie4x2``, ``cpux4``, ``2x4``, or ``h100x8x16``
    (16 nodes of 8 GPUs, one InfiniBand NIC per GPU)."""
    if name == "2x4":
        return Topology(name, _gpus("a100", 8, 4), _nvlink("a100"), INFINIBAND)
    nodes = re.fullmatch(r"(a100|h100|h200)x8x(\d+)", name)
    if nodes is not None:
        family, count = nodes.group(1), int(nodes.group(2))
        if not 1 <= count <= MOST_NODES:
            raise EdlError(
                f"unknown topology '{name}': {count} nodes",
                help=f"multi-node presets have 1 to {MOST_NODES} nodes of 8",
            )
        inter = _ib(family) if count > 1 else None
        return Topology(name, _gpus(family, NODE_GPUS * count, NODE_GPUS), _nvlink(family), inter)
    m = re.fullmatch(r"(a100|h100|h200|pcie4|cpu)x(\d+)", name)
    if m is None or not 1 <= int(m.group(2)) <= 8:
        raise EdlError(f"unknown topology '{name}'", help=f"presets: {PRESETS_HELP}; or a .toml/.json file")
    family, n = m.group(1), int(m.group(2))
    if family in _GPUS:
        return Topology(name, _gpus(family, n), _nvlink(family))
    if family == "pcie4":
        return Topology(name, _gpus("a100", n), PCIE4)
    # CPU "devices": cores of one host sharing memory; copies run at memcpy speed; gloo moves them.
    devices = tuple(Device(i, 0, "CPU", 16 * GIB, 1e11, 20e9) for i in range(n))
    return Topology(name, devices, Link("shm", 10e9, 1e-6), library=Library.GLOO)


# -- custom machines ----------------------------------------------------------------------------

_UNITS = {
    "": 1,
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "t": 1e12,
    "p": 1e15,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def quantity(value: object, unit: str, what: str) -> float:
    """A number, or a string such as ``80GB``, ``80GiB``, ``300GB/s``, ``312TFLOPS``, ``3us``."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        text = value.strip().replace(" ", "")
        if unit == "s":
            m = re.fullmatch(r"([0-9.eE+-]+)(s|ms|us|µs|ns)?", text)
            if m:
                try:
                    return float(m.group(1)) * _TIME[m.group(2) or "s"]
                except ValueError:
                    pass
        else:
            m = re.fullmatch(r"([0-9.eE+-]+)([kKmMgGtTpP]i?)?(" + unit + r")?", text, flags=re.IGNORECASE)
            if m:
                try:
                    return float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
                except ValueError:
                    pass
    raise EdlError(f"bad {what}: {value!r}", help=f"write a number or a string such as {_EXAMPLE[unit]}")


_EXAMPLE = {"B": "'80GB' or '80GiB'", "B/s": "'300GB/s'", "FLOPS": "'312TFLOPS'", "s": "'3us'", "": "0.7"}


def load(path: str) -> Topology:
    """A custom machine from a TOML or JSON file:

    name = "my-box"
    nodes = [4, 4]                    # devices per node
    [device]
    kind = "A100-80GB"
    memory = "80GiB"
    flops = "312TFLOPS"               # or per dtype: { default = "312TFLOPS", f32 = "19.5TFLOPS" }
    bandwidth = "2TB/s"
    sms = 108                         # optional: SMs, for GEMM wave quantization (0: none)
    general_bandwidth = "1GB/s"       # optional: the runtime's general evaluator (0: not modeled)
    attention_flops = { bf16 = "100TFLOPS" }  # optional: a fused attention's rate per dtype (default: flops)
    [links.intra]
    name = "nvlink"
    bandwidth = "230GB/s"             # per device and direction, all transfers together; collectives
    p2p_bandwidth = "72GB/s"          # optional: one point-to-point transfer (default: bandwidth)
    latency = "3us"
    collective_latency = "3us"        # optional: one step of a collective (default: latency)
    exchange_latency = "6us"          # optional: one step of a small all-reduce run as pairwise
                                      # exchanges, gloo's across nodes (default: twice latency)
    shared_memory_latency = "20us"    # optional: one chunk of an all-reduce through shared memory,
                                      # gloo's ranks of one node (default: 20us)
    interference = 0.0                # optional: the share of a transfer's time its ends cannot compute
    [links.inter]                     # needed when there are several nodes
    bandwidth = "25GB/s"
    latency = "10us"
    library = "nccl"                  # optional: "nccl" (default) or "gloo", the runtime's backend
    shared_memory = true              # optional (gloo): a node's ranks all-reduce through shared memory
    [measured]                        # optional, any content: what `edl calibrate` measured
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise EdlError(f"cannot read topology file {path}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text) if p.suffix.lower() == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EdlError(f"topology file {path} is not valid {p.suffix[1:].upper() or 'JSON'}: {exc}") from None
    if not isinstance(data, dict):
        raise EdlError(f"topology file {path} must hold a table")
    return from_dict(data, default_name=p.stem)


_KEYS = {
    "": {
        "name",
        "nodes",
        "device",
        "links",
        "efficiency",
        "kernel_floor",
        "kernel_floors",
        "call_overhead",
        "library",
        "shared_memory",
        "measured",
    },
    "kernel_floors": {c.value for c in KernelClass},
    "device": {"kind", "memory", "flops", "bandwidth", "sms", "general_bandwidth", "attention_flops"},
    "links": {"intra", "inter"},
    "link": {
        "name",
        "bandwidth",
        "p2p_bandwidth",
        "latency",
        "collective_latency",
        "exchange_latency",
        "shared_memory_latency",
        "interference",
    },
}


def _optional_seconds(spec: dict[str, Any], link: str, key: str) -> float | None:
    """A link's optional latency ``key`` (seconds, at least 0), None where not given."""
    value = spec.get(key)
    if value is None:
        return None
    where = f"links.{link}.{key}"
    return _positive(quantity(value, "s", where), where, allow_zero=True)


def _table(obj: object, what: str, keys: set[str]) -> dict[str, Any]:
    """A table of the machine file, with no keys but ``keys`` (a misspelt key is an error, never
    silently a default)."""
    if not isinstance(obj, dict):
        raise EdlError(f"topology: '{what}' must be a table")
    for key in obj:
        if key not in keys:
            where = f" in [{what}]" if what else ""
            raise EdlError(f"topology: unknown key '{key}'{where}", help=did_you_mean(key, keys, "keys"))
    return obj


def _positive(value: float, what: str, allow_zero: bool = False) -> float:
    if not (value > 0 or (allow_zero and value == 0)) or value != value:  # also rejects NaN
        raise EdlError(f"topology: {what} must be {'non-negative' if allow_zero else 'positive'}, not {value:g}")
    return value


_DTYPES = ("f64", "f32", "f16", "bf16")


def _attention_peaks(spec: object) -> Peaks:
    """``[device] attention_flops``: a fused attention kernel's rate per dtype, e.g.
    ``attention_flops = { bf16 = "80GFLOPS" }`` (dtypes not named: the device's flops)."""
    return tuple(sorted(_rates(_table(spec, "device.attention_flops", set(_DTYPES)), "attention_flops").items()))


def _rates(table: dict[str, Any], what: str) -> dict[str, float]:
    """A machine file's table of FLOP/s by dtype, each a positive quantity."""
    return {k: _positive(quantity(v, "FLOPS", f"{what} of {k}"), f"device {what} of {k}") for k, v in table.items()}


def _peaks(spec: object) -> tuple[float, Peaks]:
    """``[device] flops``: one rate for every dtype, or a table of rates per dtype with a
    ``default`` for the dtypes it does not name (``flops = { default = "312TFLOPS", f32 =
    "19.5TFLOPS" }``)."""
    if not isinstance(spec, dict):
        return _positive(quantity(spec, "FLOPS", "device flops"), "device flops"), ()
    table = _table(spec, "device.flops", {"default", *_DTYPES})
    if "default" not in table:
        raise EdlError(
            "topology: [device] flops per dtype needs a 'default' rate, for the dtypes it does not name",
            help='e.g. flops = { default = "312TFLOPS", f32 = "19.5TFLOPS" }',
        )
    rates = _rates(table, "flops")
    default = rates.pop("default")
    return default, tuple(sorted(rates.items()))


def from_dict(data: dict[str, Any], default_name: str = "custom") -> Topology:
    data = _table(data, "", _KEYS[""])
    if not isinstance(data.get("measured", {}), dict):  # informational (edl calibrate's raw numbers): ignored
        raise EdlError("topology: 'measured' must be a table", help="it holds what `edl calibrate` measured")
    nodes = data.get("nodes", [1])
    if not isinstance(nodes, list) or not nodes or not all(isinstance(n, int) and n > 0 for n in nodes):
        raise EdlError("topology: 'nodes' must be a list of device counts, e.g. nodes = [4, 4]")
    dev = _table(data.get("device", {}), "device", _KEYS["device"])
    kind = str(dev.get("kind", "GPU"))
    memory = int(_positive(quantity(dev.get("memory", "80GiB"), "B", "device memory"), "device memory"))
    flops, peaks = _peaks(dev.get("flops", "312TFLOPS"))
    bw = _positive(quantity(dev.get("bandwidth", "2TB/s"), "B/s", "device bandwidth"), "device bandwidth")
    sms = dev.get("sms", 0)
    if not isinstance(sms, int) or isinstance(sms, bool) or sms < 0:
        raise EdlError(f"topology: device sms must be a whole number of SMs (0: none), not {sms!r}")
    general = quantity(dev.get("general_bandwidth", 0), "B/s", "device general_bandwidth")
    general = _positive(general, "device general_bandwidth", allow_zero=True)
    attention = _attention_peaks(dev.get("attention_flops", {}))
    try:
        library = Library(str(data.get("library", "nccl")).lower())
    except ValueError:
        raise EdlError(
            f"topology: unknown library {data['library']!r}",
            help='library = "nccl" (GPUs) or "gloo" (CPU processes): the torch.distributed backend',
        ) from None
    links = _table(data.get("links", {}), "links", _KEYS["links"])

    def link(key: str, default: Link | None) -> Link | None:
        if key not in links:
            return default
        spec = _table(links[key], f"links.{key}", _KEYS["link"])
        bandwidth = quantity(spec.get("bandwidth", "25GB/s"), "B/s", f"links.{key}.bandwidth")
        pair = spec.get("p2p_bandwidth")
        p2p = None if pair is None else quantity(pair, "B/s", f"links.{key}.p2p_bandwidth")
        latency = quantity(spec.get("latency", "5us"), "s", f"links.{key}.latency")
        step_latency, exchange_latency, shared_memory_latency = (
            _optional_seconds(spec, key, k) for k in ("collective_latency", "exchange_latency", "shared_memory_latency")
        )
        interference = quantity(spec.get("interference", 0.0), "", f"links.{key}.interference")
        if not 0 <= interference <= 1:
            raise EdlError(
                f"topology: links.{key}.interference is the fraction of a transfer's time its ends lose from "
                f"computing, in [0, 1], not {interference:g}",
                help="0: transfers run beside the kernels (GPUs); 1: the computing cores copy the bytes (gloo on CPU)",
            )
        return Link(
            str(spec.get("name", key)),
            _positive(bandwidth, f"links.{key}.bandwidth"),
            _positive(latency, f"links.{key}.latency", allow_zero=True),
            interference,
            None if p2p is None else _positive(p2p, f"links.{key}.p2p_bandwidth"),
            step_latency,
            exchange_latency,
            shared_memory_latency,
        )

    intra = link("intra", Link("nvlink", 300e9, NVLINK_LATENCY))
    inter = link("inter", None)
    assert intra is not None
    if len(nodes) > 1 and inter is None:
        raise EdlError("topology: several nodes need [links.inter] (bandwidth and latency between nodes)")
    efficiency = quantity(data.get("efficiency", 0.7), "", "efficiency")
    if not 0 < efficiency <= 1:
        raise EdlError(
            f"topology: efficiency is the fraction of peak that kernels reach, in (0, 1], not {efficiency:g}"
        )
    floor = _positive(quantity(data.get("kernel_floor", "5us"), "s", "kernel_floor"), "kernel_floor", allow_zero=True)
    overhead = _positive(quantity(data.get("call_overhead", 0), "s", "call_overhead"), "call_overhead", allow_zero=True)
    floors_table = _table(data.get("kernel_floors", {}), "kernel_floors", _KEYS["kernel_floors"])
    floors = tuple(
        (cls, _positive(quantity(floors_table[cls.value], "s", where), where, allow_zero=True))
        for cls in KernelClass
        if cls.value in floors_table
        for where in (f"kernel_floors.{cls.value}",)
    )
    devices: list[Device] = []
    for node, count in enumerate(nodes):
        devices.extend(
            Device(len(devices), node, kind, memory, flops, bw, peaks, sms, general, attention) for _ in range(count)
        )
    name = str(data.get("name", default_name))
    shared = data.get("shared_memory", True)
    if not isinstance(shared, bool):
        raise EdlError(
            f"topology: shared_memory is true or false, not {shared!r}",
            help="false: gloo's ranks of a node cannot all-reduce through shared memory (not x86-64, no /dev/shm)",
        )
    topo = Topology(name, tuple(devices), intra, inter, efficiency, floor, library, overhead, floors, shared)
    topo.verify()
    return topo


def resolve(spec: str | Topology) -> Topology:
    """A preset name, a path to a .toml/.json file, or a Topology."""
    if isinstance(spec, Topology):
        return spec
    if spec.lower().endswith((".toml", ".json")):
        return load(spec)
    try:
        return preset(spec)
    except EdlError:
        names = [f"{f}x{n}" for f in ("a100", "h100", "h200", "pcie4", "cpu") for n in (2, 4, 8)] + ["2x4"]
        names += [f"{f}x8x{m}" for f in ("a100", "h100", "h200") for m in (2, 4, 8, 16, 32, 64)]
        raise EdlError(
            f"unknown topology '{spec}'",
            help=did_you_mean(spec, names) or f"presets: {PRESETS_HELP}; or a .toml/.json file",
        ) from None
