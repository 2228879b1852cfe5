"""Ring on COMM_SELF (in-process): streams and tags, refusing misuse, deadlines, records.

On one rank ``prev == next == rank``, so every send is received by this
process: enough to check which receive a message lands in.
"""

import numpy as np
import pytest
from mpi4py import MPI

from ringmpi.runtime.errors import RingTimeout
from ringmpi.parallel.ring import Ring


def test_a_third_stream_has_its_own_tag():
    """A message on a new stream must not land in a pending receive of "grad"."""
    ring = Ring(MPI.COMM_SELF, timeout=5)
    grad_buf, third_buf = np.zeros(4, np.uint8), np.zeros(4, np.uint8)
    ring.post("grad_in", recv=grad_buf, stream="grad")
    ring.post("third_in", recv=third_buf, stream="third")
    ring.post("third_out", send=np.full(4, 7, np.uint8), stream="third")
    ring.wait("third_out")
    ring.wait("third_in")
    assert third_buf.tolist() == [7] * 4 and grad_buf.tolist() == [0] * 4
    ring.post("grad_out", send=np.full(4, 9, np.uint8), stream="grad")
    ring.wait_all()
    assert grad_buf.tolist() == [9] * 4
    tags = [ring._tag(s) for s in ("kv", "grad", "third", "fourth")]
    assert len(set(tags)) == 4


def test_message_parts_arrive_in_order_on_one_channel():
    ring = Ring(MPI.COMM_SELF, timeout=5)
    a, b = np.zeros(3, np.uint8), np.zeros(5, np.uint8)
    ring.post("kv", send=[np.full(3, 1, np.uint8), np.full(5, 2, np.uint8)], recv=[a, b])
    ring.wait("kv")
    assert a.tolist() == [1] * 3 and b.tolist() == [2] * 5
    rec = ring.records[0]
    assert (rec.bytes_sent, rec.bytes_recv) == (8, 8)


def test_refuses_to_post_on_a_pending_channel():
    ring = Ring(MPI.COMM_SELF, timeout=5)
    buf = np.zeros(2, np.uint8)
    ring.post("kv", recv=buf)
    with pytest.raises(RuntimeError, match="pending"):
        ring.post("kv", recv=np.zeros(2, np.uint8))
    ring.post("other", send=np.ones(2, np.uint8), stream="kv")
    ring.wait_all()
    assert buf.tolist() == [1, 1]


def test_wait_past_the_deadline_names_step_channel_and_peer():
    ring = Ring(MPI.COMM_SELF, timeout=0.05)
    ring.next_step()
    buf = np.zeros(16, np.uint8)
    ring.post("kv", recv=buf)
    with pytest.raises(RingTimeout, match=r"rank 0: ring step 1 channel 'kv' .*recv from rank 0.*16 bytes"):
        ring.wait("kv")
    ring.post("late", send=np.ones(16, np.uint8), stream="kv")  # let the stuck receive finish
    ring.wait_all()


def test_the_step_advances_only_through_next_step():
    ring = Ring(MPI.COMM_SELF)
    assert ring.step == 0
    assert ring.next_step() == 1 and ring.step == 1
    with pytest.raises(AttributeError):
        ring.step = 5
    assert ring.record(2).step == 2 and len(ring.records) == 3


def test_wait_without_post_is_a_no_op_and_tick_is_cheap():
    ring = Ring(MPI.COMM_SELF, timeout=0.01)
    ring.wait("nothing")
    ring.tick()
    assert ring.records == []
