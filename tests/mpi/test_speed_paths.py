"""The NumPy backend's speed paths change no bit of any result (issue 15).

* ``resident``: what a block op derives from the resident operands (rounded
  ``q``/``do``, their NaN/Inf scans, scratch) is made on the first block of a
  call and reused; every block of a call must give bitwise what a block op
  without ``resident`` gives, with and without non-finite values.
* the backward runs key tiles outermost: bitwise the query-tile-major loop.
* in host memory the dK/dV partial sums are received into two buffers in pieces, added
  to in place and sent on piece by piece: against the whole-message channel of device
  memory (three buffers) it holds a buffer less and gives bitwise the same sums, both meet
  the float64 reference, repeats are bitwise (``speed_cases.py``, real mpirun), and
  nothing of a call outlives it.
* a lone rank allocates no message buffers and sends nothing.
"""

import numpy as np
import pytest

from random_inputs import attention_inputs
from ringmpi.backends.numpy_backend import NumpyBackend
from ringmpi.core.masks import BlockMask, ScoreSpec

B, N, H, HKV, D = 2, 37, 4, 2, 8
SPLITS = (0, 11, 25, 37)  # three visiting blocks of uneven length


def _arrays(seed, bad=None):
    """The float32 inputs by name, with ``bad = (name, value, token)`` written into one of them."""
    arrays = dict(zip(("q", "k", "v", "do"), attention_inputs(seed, B, N, H, HKV, D, dtype=np.float32)))
    if bad is not None:
        name, value, token = bad
        arrays[name][1, token, 1 if name in ("q", "do") else 0, 3] = value
    return arrays


def _blocks(be, k, v, spec):
    for lo, hi in zip(SPLITS[:-1], SPLITS[1:]):
        yield (be.to_heads(k[:, lo:hi], np.float32), be.to_heads(v[:, lo:hi], np.float32),
               BlockMask(spec, np.arange(N), np.arange(lo, hi)))


def _forward(be, x, spec, resident):
    qh = be.to_heads(x["q"], np.float32)
    o_acc, m, l = np.zeros(qh.shape, np.float32), np.full(qh.shape[:3], -np.inf, np.float32), np.zeros(qh.shape[:3], np.float32)
    with np.errstate(all="ignore"):
        for kh, vh, mask in _blocks(be, x["k"], x["v"], spec):
            be.forward_block(qh, kh, vh, o_acc, m, l, 0.3, mask, resident=resident)
    return o_acc, m, l


def _backward(be, x, spec, resident):
    qh, doh = be.to_heads(x["q"], np.float32), be.to_heads(x["do"], np.float32)
    o_acc, m, l = _forward(be, x, spec, None)
    with np.errstate(all="ignore"):
        o, lse = be.finalize(o_acc, m, l, np.float32)
        dvec = be.row_dot(doh, be.to_heads(o, np.float32))
    dq = np.zeros_like(qh)
    grads = []
    with np.errstate(all="ignore"):
        for kh, vh, mask in _blocks(be, x["k"], x["v"], spec):
            dk, dv = np.zeros_like(kh), np.zeros_like(vh)
            be.backward_block(qh, doh, lse, dvec, kh, vh, dq, dk, dv, 0.3, mask, resident=resident)
            grads += [dk, dv]
    return [dq] + grads


@pytest.mark.parametrize("bad", [None, ("q", np.nan, 5), ("k", np.inf, 20), ("v", np.nan, 30), ("do", -np.inf, 9)])
@pytest.mark.parametrize("tiles", [(512, 512), (5, 4)])
def test_resident_state_is_bitwise_the_per_block_computation(monkeypatch, bad, tiles):
    import ringmpi.backends.numpy_backend as nb

    monkeypatch.setattr(nb, "TILE_Q", tiles[0])
    monkeypatch.setattr(nb, "TILE_KV", tiles[1])
    be = NumpyBackend()
    x = _arrays(1, bad)
    spec = ScoreSpec(causal=True)
    resident = {}
    for got, want in zip(_forward(be, x, spec, resident), _forward(be, x, spec, None)):
        np.testing.assert_array_equal(got, want)
    assert resident, "the forward kept nothing across blocks"
    resident = {}
    for got, want in zip(_backward(be, x, spec, resident), _backward(be, x, spec, None)):
        np.testing.assert_array_equal(got, want)
    assert resident, "the backward kept nothing across blocks"


@pytest.mark.parametrize("bad", [None, ("k", np.nan, 20), ("do", np.inf, 9)])
def test_backward_key_tile_order_is_bitwise_the_query_tile_order(monkeypatch, bad):
    """The backward runs key tiles outermost (so dk, dv finish tile by tile); every
    accumulator adds its terms in the order of the query-tile-major loop."""
    import ringmpi.backends.numpy_backend as nb

    monkeypatch.setattr(nb, "TILE_Q", 5)
    monkeypatch.setattr(nb, "TILE_KV", 4)
    be = NumpyBackend()
    x = _arrays(2, bad)
    finished = []
    spec = ScoreSpec(causal=True, window=(20, None))
    qh, doh = be.to_heads(x["q"], np.float32), be.to_heads(x["do"], np.float32)
    kh, vh = be.to_heads(x["k"], np.float32), be.to_heads(x["v"], np.float32)
    rng = np.random.default_rng(0)
    lse = rng.standard_normal((B, H, N)).astype(np.float32) + 3
    dvec = rng.standard_normal((B, H, N)).astype(np.float32)
    seg = np.broadcast_to(np.arange(N) // 13, (B, N)).astype(np.int64)
    mask = BlockMask(spec, np.arange(N), np.arange(N), seg, seg)
    results = []
    for kv_major in (True, False):
        monkeypatch.setattr(nb._TilePlan, "__init__", _forced_order(nb._TilePlan.__init__, kv_major))
        grads = [np.zeros_like(qh), np.zeros_like(kh), np.zeros_like(vh)]
        with np.errstate(all="ignore"):
            be.backward_block(qh, doh, lse, dvec, kh, vh, *grads, 0.3, mask,
                              kv_done=finished.append if kv_major else None)
        results.append(grads)
        monkeypatch.undo()
        monkeypatch.setattr(nb, "TILE_Q", 5)
        monkeypatch.setattr(nb, "TILE_KV", 4)
    for got, want in zip(*results):
        np.testing.assert_array_equal(got, want)
    assert finished == sorted(finished) and finished[-1] == N and len(finished) > 3


def _forced_order(init, kv_major):
    def forced(self, *args, **kwargs):
        kwargs["kv_major"] = kv_major
        init(self, *args, **kwargs)
    return forced


def test_a_lone_rank_allocates_no_message_buffers():
    """P = 1: one K/V slot (its own block), one dK/dV buffer (its own sums), nothing sent."""
    from mpi4py import MPI

    from ringmpi.parallel.ring_schedule import RingSchedule

    be = NumpyBackend()
    x = _arrays(3)
    kh, vh = be.to_heads(x["k"], np.float32), be.to_heads(x["v"], np.float32)
    schedule = RingSchedule(MPI.COMM_SELF, be, kh, vh, kv_counts=[N], q_pos=np.arange(N),
                            kv_pos=np.arange(N), spec=ScoreSpec(), grad_dtype=np.float32)
    blocks = list(schedule)
    assert len(schedule.kv.msgs) == len(schedule.kv.meta) == 1
    assert len(schedule.grads.bufs) == 1
    assert blocks[0].rows == {}
    dk, dv = schedule.finished_grads()
    assert np.shares_memory(dk, schedule.grads.bufs[0].mpi_buffer())
    assert sum(r.bytes_sent + r.bytes_recv for r in schedule.records) == 0


# ------------------------------------------------------------ the backward's gradient channels
from mpi_util import launch_cache, mpirun_env, run_cases  # noqa: E402

PIECE_CASES = [
    dict(id="causal-zigzag-gqa", seed=1, B=2, N=45, H=4, Hkv=2, D=8, layout="zigzag", causal=True),
    dict(id="full-contiguous", seed=2, B=1, N=31, H=2, Hkv=2, D=5, layout="contiguous", causal=False),
    dict(id="segments-striped", seed=3, B=2, N=40, H=2, Hkv=1, D=4, layout="striped", causal=True, segments=3),
    dict(id="n-below-p", seed=4, B=1, N=2, H=2, Hkv=1, D=4, layout="contiguous", causal=False),
]
# one tile per block at P = 2; many tiles per block (many kv_need/kv_done calls) at P = 3
PIECE_LAUNCHES = {"tiles-default-P2": (2, {}), "tiles-4x3-P3": (3, {"RINGMPI_TILE_Q": 4, "RINGMPI_TILE_KV": 3})}


def _piece_launch(launch, tmp_path_factory):
    p, env = PIECE_LAUNCHES[launch]
    return run_cases(p, PIECE_CASES, tmp_path_factory.mktemp(launch), timeout=240, env=mpirun_env(**env),
                     driver="speed_cases.py")


_piece_results = launch_cache(_piece_launch)


@pytest.mark.mpi
@pytest.mark.parametrize("launch", sorted(PIECE_LAUNCHES))
@pytest.mark.parametrize("case", [c["id"] for c in PIECE_CASES])
def test_gradients_in_place_hold_a_buffer_less_and_agree(tmp_path_factory, launch, case):
    """Host memory's in-place dK/dV channel against the whole-message one (tests/mpi/speed_cases.py)."""
    ok, msg = _piece_results(launch, tmp_path_factory)[case]
    assert ok, msg


MEMORY_CASES = [dict(id="memory-causal", seed=5, B=1, N=1024, H=2, Hkv=2, D=64, layout="contiguous",
                     causal=True, memory=True)]
MEMORY_LAUNCHES = {"P2": 2, "P3": 3}  # key tiles of 64 rows: the scratch is 1/8 and 1/5 of a block


def _memory_launch(launch, tmp_path_factory):
    return run_cases(MEMORY_LAUNCHES[launch], MEMORY_CASES, tmp_path_factory.mktemp("memory-" + launch),
                     timeout=240, driver="speed_cases.py", env=mpirun_env(RINGMPI_TILE_KV=64))


_memory_results = launch_cache(_memory_launch)


@pytest.mark.mpi
@pytest.mark.parametrize("launch", sorted(MEMORY_LAUNCHES))
def test_gradients_in_place_peak_a_buffer_lower(tmp_path_factory, launch):
    """At blocks of 512 and 342 rows the in-place channel's peak is one dK/dV buffer lower,
    less the block op's key tile of scratch."""
    ok, msg = _memory_results(launch, tmp_path_factory)["memory-causal"]
    assert ok, msg
