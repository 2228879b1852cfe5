"""Runs of ``jobs/train_context_parallel.py`` under mpirun: 5 Adam steps of a small model over
301 tokens (uneven zigzag shards), losses, final parameters and last summed gradients back."""

import sys

import numpy as np

from mpi_util import ROOT, mpirun

TRAIN = ["--seq-len", 301, "--steps", 5, "--dim", 32, "--heads", 4, "--kv-heads", 2, "--layers", 2]


def train_example(tmp_path, size, dtype, *flags, device="cpu"):
    """``{name: array}`` of one run on ``size`` ranks (``--save``'s npz); fails the calling test
    unless it exits 0 having printed every step."""
    out = tmp_path / f"p{size}-{dtype}-{device}.npz"
    rc, stdout, stderr, _ = mpirun(size, [sys.executable, ROOT / "jobs" / "train_context_parallel.py", *TRAIN,
                                          *flags, "--dtype", dtype, "--device", device, "--save", out], timeout=240)
    assert rc == 0 and "step   4  loss" in stdout, \
        f"P={size} {dtype} {device}: exit {rc}\n{stdout[-2000:]}\n{stderr[-3000:]}"
    with np.load(out) as data:
        return dict(data)
