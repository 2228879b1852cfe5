"""The flat ring's order from the node split (pure functions; across hosts: test_multinode.py)."""

import pytest
from mpi4py import MPI

from ringmpi.parallel.ring import Ring
from ringmpi.parallel.topology import ring_order, ring_order_of


@pytest.mark.parametrize("nodes,order", [
    ([0, 0, 2, 2], [0, 1, 2, 3]),            # block placement: rank order, results unchanged
    ([0, 1, 0, 1], [0, 2, 1, 3]),            # cyclic (--map-by node): node by node
    ([0, 1, 2, 0, 1, 2], [0, 3, 1, 4, 2, 5]),
    ([3, 3, 0, 3, 0], [0, 1, 3, 2, 4]),      # nodes in order of their lowest rank
    ([0], [0]),
])
def test_ring_order_goes_node_by_node(nodes, order):
    assert ring_order_of(nodes) == order
    hops = sum(nodes[a] != nodes[b] for a, b in zip(order, order[1:] + order[:1]))
    assert hops == (len(set(nodes)) if len(set(nodes)) > 1 else 0)


def test_ring_takes_an_order():
    assert ring_order(MPI.COMM_SELF) == [0]
    ring = Ring(MPI.COMM_SELF, order=[0])
    assert (ring.next, ring.prev, ring.source(0), ring.source(5)) == (0, 0, 0, 0)
    with pytest.raises(ValueError, match="not a permutation"):
        Ring(MPI.COMM_SELF, order=[1])
