"""Collective-time primitives of the throughput simulator (autotune.simulate and
autotune.simulate_long): ring collectives, overlap with compute, link bandwidth. Pure arithmetic."""

from __future__ import annotations

from autotune.spec import HardwareSpec


def _ring_time(volume_bytes: float, n: int, bw: float, lat: float) -> float:
    """Ring all-gather / reduce-scatter of a buffer of volume_bytes over n ranks.

    Source: Thakur et al. 2005 / NCCL docs (performance.md): time = (n-1)/n * V / busBW + (n-1)*alpha.
    """
    if n <= 1 or volume_bytes <= 0:
        return 0.0
    return (n - 1) / n * volume_bytes / bw + (n - 1) * lat


def _exposed(comm: float, window: float, overlap: float) -> float:
    """Communication left on the critical path when it runs concurrently with `window` of compute.

    What exceeds the window is exposed; of the part that fits, (1-overlap) still costs (SM and HBM
    contention, imperfect prefetch) - the usual overlap model of e.g. Calculon (Isaev et al. 2023, sec. 3).
    """
    hidden = min(comm, window)
    return (comm - hidden) + (1.0 - overlap) * hidden


def _link_bandwidth(hardware: HardwareSpec, p: dict, crosses_nodes: bool) -> float:
    """Bytes/s of one GPU's ring: NVLink inside a node; across nodes NCCL runs one ring channel per
    NIC (rail-aligned), so the ring gets the node's aggregate NIC bandwidth per GPU, capped by
    NVLink (nccl-tests doc/PERFORMANCE.md, busBW)."""
    gpu = hardware.gpu
    link = min(gpu.intra_node_bandwidth_gbps, gpu.inter_node_bandwidth_gbps * hardware.gpus_per_node) \
        if crosses_nodes else gpu.intra_node_bandwidth_gbps
    return link * 1e9 * p["comm_eff"]
