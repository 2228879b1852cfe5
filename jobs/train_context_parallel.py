"""Train a small causal transformer LM with context parallelism over MPI.

    mpirun -n 2 python jobs/train_context_parallel.py [--seq-len 4096 --steps 20]

One long synthetic token sequence is split across the ranks with the zigzag
layout (which balances causal work).  Every rank holds the same parameters
and runs embedding, attention (``ringmpi.torch.RingSelfAttention``: K/V
blocks travel the ring, no torch.distributed needed), MLP and loss on its own
tokens; the gradients of the replicated parameters are summed over the ranks
with ``comm.Allreduce``, so every rank takes the same optimizer step.  The
losses equal a one-rank run's to rounding.  Rank 0 prints the loss of every
step; ``--save out.npz`` also stores the losses, final parameters and the last
step's summed gradients.  ``--device cuda`` runs the model on the GPU (the ring's
block kernels on CuPy); the gradients are summed through host copies.
"""

import argparse

import numpy as np
import torch
from mpi4py import MPI

import ringmpi
from ringmpi.torch import RingSelfAttention


class Block(torch.nn.Module):
    def __init__(self, dim, heads, kv_heads, **attention):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.attn = RingSelfAttention(dim, heads, kv_heads, causal=True, **attention)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(torch.nn.Module):
    """tokens (1, S_local) at global positions (S_local,) -> logits (1, S_local, vocab)."""

    def __init__(self, vocab, seq_len, dim, heads, kv_heads, layers, **attention):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(seq_len, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads, kv_heads, **attention) for _ in range(layers))
        self.norm, self.head = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, vocab)

    def forward(self, tokens, positions):
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def synthetic_sequence(n, vocab, seed):
    """A random motif repeated with 10 % noise: predicting it needs attention far back."""
    rng = np.random.default_rng(seed)
    motif = rng.integers(0, vocab, size=61)
    tokens = np.resize(motif, n)
    noise = rng.random(n) < 0.1
    tokens[noise] = rng.integers(0, vocab, size=int(noise.sum()))
    return torch.from_numpy(tokens)


def add_training_arguments(parser, seq_len, steps, dim):
    """The options both training examples share: model shape, optimiser, dtype, seed, output."""
    parser.add_argument("--seq-len", type=int, default=seq_len)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--dim", type=int, default=dim)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", help="rank 0 writes losses and final parameters here (.npz)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_training_arguments(parser, seq_len=4096, steps=20, dim=64)
    parser.add_argument("--sinks", action="store_true", help="a learned attention sink per head (gpt-oss)")
    parser.add_argument("--device", default="cpu", help="torch device of the model: cpu, cuda, cuda:1, ...")
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.manual_seed(args.seed)  # the same initial parameters on every rank (and in either dtype)
    layout = ringmpi.Layout("zigzag", args.seq_len, comm.Get_size())
    ring = ringmpi.RingContext(comm, layout="zigzag")        # where every attention call runs
    model = TinyLM(args.vocab, args.seq_len, args.dim, args.heads, args.kv_heads, args.layers,
                   sinks=args.sinks, context=ring).to(args.device, getattr(torch, args.dtype))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    tokens = synthetic_sequence(args.seq_len, args.vocab, args.seed)
    positions = torch.from_numpy(layout.indices(rank))        # this rank's global token positions
    has_target = positions < args.seq_len - 1                # the last token predicts nothing
    inputs = tokens[positions][None].to(args.device)
    targets = tokens[(positions + 1).clamp(max=args.seq_len - 1)].to(args.device)
    has_target, positions = has_target.to(args.device), positions.to(args.device)

    losses = []
    for step in range(args.steps):
        optimizer.zero_grad()
        logits = model(inputs, positions)[0]
        # this rank's share of the mean loss over all predicted tokens
        loss = torch.nn.functional.cross_entropy(logits[has_target], targets[has_target],
                                                 reduction="sum") / (args.seq_len - 1)
        loss.backward()
        for p in model.parameters():                          # sum the replicated gradients
            grad = p.grad.cpu().numpy()                       # (a view of p.grad on the CPU)
            comm.Allreduce(MPI.IN_PLACE, grad)
            if p.grad.device.type != "cpu":
                p.grad.copy_(torch.from_numpy(grad))
        optimizer.step()
        losses.append(comm.allreduce(loss.item()))
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.6f}", flush=True)

    if rank == 0 and args.save:
        params = {f"param/{name}": p.detach().cpu().numpy() for name, p in model.named_parameters()}
        grads = {f"grad/{name}": p.grad.cpu().numpy() for name, p in model.named_parameters()}
        np.savez(args.save, losses=np.array(losses), **params, **grads)


if __name__ == "__main__":
    main()
