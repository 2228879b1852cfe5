"""Described machines for ``ringmpi plan``: presets of common GPU nodes and their networks.

Each preset is a :class:`~ringmpi.core.cost_model.Machine` per rank (one GPU) with the
figures assumed for it, every one overridable on the command line.  The attention
rate is a FlashAttention-class kernel's forward rate in 16-bit on one GPU (the
FLOPs of :func:`ringmpi.core.cost_model.Shape.flops` per second), not the
GPU's peak; the links are one direction's bandwidth and a small message's latency:
``intra`` between the GPUs of a node (NVLink/NVSwitch, or PCIe), ``inter`` between
nodes per network port, ``ranks_per_nic`` GPUs sharing one port; ``backward_rate``
the backward's rate where one is measured for the preset's kernel (else the forward's);
``torus`` a node whose ranks are wired as a torus (a TPU host's chips), ``intra`` then
being one of its links.  They are assumptions, stated here once (docs/performance.md's
table cites them).
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost_model import Link, Machine

GB = 1e9
GIB = float(1 << 30)


@dataclass(frozen=True)
class Preset:
    name: str
    machine: Machine
    about: str


PRESETS = {p.name: p for p in (
    Preset("h100-ib", Machine(rate=400e12, intra=Link(3e-6, 450 * GB), inter=Link(5e-6, 50 * GB),
                              ranks_per_node=8, memory=80 * GIB, ranks_per_nic=1),
           "DGX/HGX H100 SXM: NVLink 4 (450 GB/s a direction), one 400 Gb/s InfiniBand NDR port per GPU"),
    Preset("h200-ib", Machine(rate=420e12, intra=Link(3e-6, 450 * GB), inter=Link(5e-6, 50 * GB),
                              ranks_per_node=8, memory=141 * GIB, ranks_per_nic=1),
           "HGX H200: as h100-ib with 141 GB per GPU"),
    Preset("a100-ib", Machine(rate=180e12, intra=Link(3e-6, 300 * GB), inter=Link(5e-6, 25 * GB),
                              ranks_per_node=8, memory=80 * GIB, ranks_per_nic=1),
           "DGX A100 80 GB: NVLink 3 (300 GB/s a direction), one 200 Gb/s InfiniBand HDR port per GPU"),
    Preset("h100-ethernet", Machine(rate=400e12, intra=Link(3e-6, 450 * GB), inter=Link(15e-6, 12.5 * GB),
                                    ranks_per_node=8, memory=80 * GIB, ranks_per_nic=8),
           "H100 SXM node on one 100 Gb/s Ethernet port shared by its 8 GPUs"),
    Preset("h800-ib", Machine(rate=325e12, intra=Link(3e-6, 200 * GB), inter=Link(5e-6, 50 * GB),
                              ranks_per_node=8, memory=80 * GIB, ranks_per_nic=1, backward_rate=287.8e12),
           "HGX H800 SXM: NVLink 4 cut to 400 GB/s (200 GB/s a direction), one 400 Gb/s InfiniBand NDR port "
           "per GPU; rate: FlashAttention-2's measured forward on one H800 (ring-flash-attention's README, "
           "591.5 iter/s at N = 8192, H = 32, D = 128, causal), below h100-ib's FlashAttention-3-class figure; "
           "backward rate: the same table's forward + backward (154.7 iter/s) less the forward, at 2.5x "
           "the forward's FLOPs (288 TFLOP/s, 0.885 of the forward's)"),
    Preset("tpu-v5p", Machine(rate=0.5 * 459e12, intra=Link(5e-6, 100 * GB), inter=Link(5e-6, 100 * GB),
                              ranks_per_node=4, memory=95 * GB, ranks_per_nic=1, torus=(2, 2)),
           "Cloud TPU v5p: 459 TFLOP/s bf16 peak at an assumed 50 % attention efficiency, 95 GB HBM, "
           "ICI 1,200 GB/s a chip both ways over 6 torus links (100 GB/s a link a direction), 4 chips a "
           "host (2 x 2); a slice of a cube or more (4 x 4 x 4) wraps in every dimension: plan a group "
           "of chips as one node with its torus (--ranks-per-node 16 --torus 4x4)"),
    Preset("l40s-pcie", Machine(rate=150e12, intra=Link(8e-6, 25 * GB), inter=Link(15e-6, 12.5 * GB),
                                ranks_per_node=8, memory=48 * GIB, ranks_per_nic=8),
           "8 x L40S on PCIe 4 (25 GB/s), one 100 Gb/s Ethernet port per node"),
)}
