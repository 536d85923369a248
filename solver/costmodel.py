"""The cost model shared by the planner and the simulator, so predictions and measurements agree.

- A kernel takes max(flops / (efficiency * peak), bytes / (efficiency * HBM bandwidth)), and at
  least the topology's kernel floor.
- A transfer takes latency + bytes / link bandwidth.
"""

from __future__ import annotations

from edatalog.solver.topology import Device, Link, Topology


def compute_seconds(flops: int, nbytes: int, device: Device, topo: Topology) -> float:
    """Roofline time of one kernel on ``device``."""
    if flops == 0 and nbytes == 0:
        return 0.0
    eff = topo.efficiency
    return max(topo.kernel_floor, flops / (eff * device.flops), nbytes / (eff * device.bandwidth))


def transfer_seconds(nbytes: int, link: Link) -> float:
    return link.latency + nbytes / link.bandwidth
