"""The cost model: what a kernel and a transfer cost on a machine.  The backend's timeline uses it
to predict a schedule's time; the planner will use the same functions, so plans are chosen by
the cost they are then measured with.

- A kernel takes max(flops / (efficiency * peak), bytes / (efficiency * HBM bandwidth)), and at
  least the topology's kernel floor; the peak is the device's for the dtype the kernel computes
  in (an A100 multiplies bf16 at 312 TFLOP/s, f32 at 19.5).
- A transfer takes latency + bytes / link bandwidth; on a link with ``interference`` f, each
  end's compute engine loses f times that (applied by the timeline).
"""

from __future__ import annotations

from edatalog.solver.topology import Device, Link, Topology


def compute_seconds(flops: int, nbytes: int, device: Device, topo: Topology, dtype: str) -> float:
    """Roofline time of one kernel computing in ``dtype`` on ``device``."""
    if flops == 0 and nbytes == 0:
        return 0.0
    eff = topo.efficiency
    return max(topo.kernel_floor, flops / (eff * device.peak(dtype)), nbytes / (eff * device.bandwidth))


def transfer_seconds(nbytes: int, link: Link) -> float:
    return link.latency + nbytes / link.bandwidth
