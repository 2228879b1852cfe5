"""Data parallel x context parallel: replicas with DDP, each replica's sequences over a ring.

    mpirun -n 4 python jobs/train_data_context_parallel.py --cp 2    # 2 replicas x 2 ring ranks

The world's ranks form ``P / cp`` data-parallel replicas of ``cp`` consecutive
ranks.  Inside a replica, ringmpi shards each sequence over the replica's
sub-communicator (zigzag) and the gradients of the replicated parameters are
summed over it (MPI); across replicas, torch's DistributedDataParallel averages
them over gloo, started from the MPI communicator by
``ringmpi.torch_distributed.init_process_group``, so the optimizer code stays
DDP's.  The global batch (``--batch`` sequences) is split over the replicas;
every step's loss is the mean over the whole batch, the same as a one-rank run
(``mpirun -n 1 ... --cp 1``) to rounding.  ``--save out.npz``: losses and final
parameters (rank 0).
"""

import argparse
import os
import sys

import numpy as np
import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ringmpi  # noqa: E402
from ringmpi import torch_distributed  # noqa: E402
from train_context_parallel import TinyLM, add_training_arguments, synthetic_sequence  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=2, help="ranks per replica (the ring)")
    parser.add_argument("--batch", type=int, default=2, help="global batch: sequences, split over the replicas")
    add_training_arguments(parser, seq_len=1024, steps=10, dim=32)
    args = parser.parse_args()

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if size % args.cp or args.batch % (size // args.cp):
        raise SystemExit(f"need P % cp == 0 and batch % (P / cp) == 0, got P={size}, cp={args.cp}, batch={args.batch}")
    replica, replicas = rank // args.cp, size // args.cp
    cp_comm = world.Split(color=replica, key=rank)            # the ring of this replica
    torch_distributed.init_process_group(world, backend="gloo")
    dp_group = torch_distributed.new_group(world, color=rank % args.cp)  # the same ring rank in every replica

    torch.manual_seed(args.seed)  # the same initial parameters everywhere (DDP checks and broadcasts them)
    model = TinyLM(args.vocab, args.seq_len, args.dim, args.heads, args.kv_heads, args.layers,
                   context=ringmpi.RingContext(cp_comm, layout="zigzag")).to(getattr(torch, args.dtype))
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=dp_group)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=args.lr)

    per_replica = args.batch // replicas
    mine = range(replica * per_replica, (replica + 1) * per_replica)     # this replica's sequences
    tokens = torch.stack([synthetic_sequence(args.seq_len, args.vocab, args.seed + i) for i in mine])
    layout = ringmpi.Layout("zigzag", args.seq_len, args.cp)
    positions = torch.from_numpy(layout.indices(cp_comm.Get_rank()))
    has_target = positions < args.seq_len - 1
    inputs = tokens[:, positions]
    targets = tokens[:, (positions + 1).clamp(max=args.seq_len - 1)]
    count = per_replica * (args.seq_len - 1)                  # predicted tokens of this replica

    losses = []
    for step in range(args.steps):
        optimizer.zero_grad()
        logits = ddp(inputs, positions)                       # DDP averages the gradients over replicas
        loss = torch.nn.functional.cross_entropy(logits[:, has_target].flatten(0, 1),
                                                 targets[:, has_target].flatten(), reduction="sum") / count
        loss.backward()
        for p in model.parameters():                          # and the ring's shares are summed (MPI)
            cp_comm.Allreduce(MPI.IN_PLACE, p.grad.numpy())
        optimizer.step()
        losses.append(world.allreduce(loss.item()) / replicas)  # the mean over the global batch
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.6f}", flush=True)

    if rank == 0 and args.save:
        params = {f"param/{name}": p.detach().numpy() for name, p in model.named_parameters()}
        np.savez(args.save, losses=np.array(losses), **params)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
