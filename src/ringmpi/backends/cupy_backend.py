"""GPU backend: launches the CUDA block kernels of :mod:`ringmpi.kernels`.

Implements the interface documented in :mod:`ringmpi.backends` with the same
arithmetic as :class:`~ringmpi.backends.numpy_backend.NumpyBackend`.

bfloat16 is ``ml_dtypes.bfloat16`` (CuPy >= 14 allocates and views it); the
kernels read it as raw 16-bit patterns.  Every method that takes a dtype also
accepts the string ``"bfloat16"``; a ``uint16`` array is never read as
bfloat16 here (:func:`ringmpi.ring_attention` does that only when told).

Streams: every launch happens on the backend's compute stream (one per
backend), inside :meth:`CupyBackend._on_stream`: the compute stream first
waits for the work already queued on the caller's current stream (so arrays
the caller prepares with ordinary CuPy calls are safe to pass in, whatever
stream is current -- a blocking stream alone is ordered only with the legacy
default stream), and the caller's stream then waits for the compute stream
(so results are safe to use the same way).  Staged messages copy on a second
stream.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import time
import weakref
from collections import OrderedDict

import numpy as np

from .. import kernels as K
from ..core.dropout import kernel_values as dropout_values
from ..core.dtypes import compute_dtype
from ..core.dtypes import resolve as resolve_dtype
from ..core.masks import BlockMask, classify_tiles, tile_bounds, tile_counts
from ..core.masks import kernel_scalars as mask_scalars
from ..core.masks import modifier_scalars
from ..core.modifiers import FIELDS as MODIFIER_FIELDS
from ..core.modifiers import MAX_KERNEL_MODIFIERS, kernel_index

_THREADS_1D = 256


def _kind_of_dtype(dtype) -> int:
    """Kernel element kind of a dtype (``ml_dtypes.bfloat16`` or ``"bfloat16"`` is bf16)."""
    dt = resolve_dtype(dtype)
    return {"float16": K.F16, "bfloat16": K.BF16, "float32": K.F32, "float64": K.F64}[dt.name]


def storage_dtype(dtype) -> np.dtype:
    """The CuPy array dtype that holds ``dtype`` (``"bfloat16"`` -> ``ml_dtypes.bfloat16``)."""
    return resolve_dtype(dtype)


def _dropout_args(mask: BlockMask, ct) -> tuple:
    """The kernels' ``DROPOUT_PARAMS`` values (common.cuh; the rule in rules.h) for this block's spec."""
    return dropout_values(mask.spec.dropout, ct)


def _segments(mask: BlockMask, batch: int):
    """``(seg_q, seg_kv)``: the block's segment ids as int64 ``(B, S)`` host arrays, or ``(None, None)``."""
    if mask.seg_q is None:
        return None, None
    if mask.seg_kv is None:
        raise ValueError("seg_q given without seg_kv")
    return (np.asarray(mask.seg_q, dtype=np.int64).reshape(batch, -1),
            np.asarray(mask.seg_kv, dtype=np.int64).reshape(batch, -1))


def _grid_1d(n: int) -> int:
    return max(1, min((int(n) + _THREADS_1D - 1) // _THREADS_1D, 65535 * 8))


@functools.lru_cache(maxsize=None)
def smem_optin_limit(device_id: int) -> int:
    """The device's opt-in dynamic shared memory per block in bytes
    (``cudaDevAttrMaxSharedMemoryPerBlockOptin``; 99 KB on compute capability
    8.6/8.9, 163 KB on 8.0, 227 KB on 9.0), queried once per device."""
    import cupy
    rt = cupy.cuda.runtime
    return int(rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, int(device_id)))


@functools.lru_cache(maxsize=None)
def compute_capability(device_id: int) -> int:
    """The device's compute capability as major * 10 + minor (75 for 7.5), queried once per device."""
    import cupy
    return int(cupy.cuda.Device(int(device_id)).compute_capability)


def _nothing_to_do(batch, heads, kv_heads, sq, skv, tick) -> bool:
    """Shared check of the block kernels: an empty block only ticks the ring."""
    if heads % kv_heads:
        raise ValueError(f"H={heads} is not a multiple of H_kv={kv_heads}")
    if sq == 0 or skv == 0 or batch == 0:
        if tick is not None:
            tick()
        return True
    return False


class CupyBackend:
    """The GPU block kernels (see :mod:`ringmpi.backends` for the interface).

    Parameters
    ----------
    device_id : int or None
        CUDA device; None means CuPy's current device.
    cuda_aware : bool or None
        Hand device buffers straight to MPI (True) or stage them through
        pinned host memory (False).  None reads ``RINGMPI_CUDA_AWARE``
        (``auto``/``on``/``off``, default ``auto``: see
        :func:`ringmpi.runtime.device.cuda_aware_mpi`).
    """

    name = "cupy"
    MODIFIERS = MODIFIER_FIELDS  # the score modifiers with per-head data it applies: all of them
    INVARIANT = True  # invariant=True: ringmpi.backends.invariant_device's block ops
    _instances: dict = {}

    @classmethod
    def instance(cls, device_id=None, cuda_aware=None) -> "CupyBackend":
        """The backend of a device (memoized; one per device and mode)."""
        import cupy
        dev = cupy.cuda.Device().id if device_id is None else int(device_id)
        key = (dev, cuda_aware)
        if key not in cls._instances:
            cls._instances[key] = cls(dev, cuda_aware)
        return cls._instances[key]

    def __init__(self, device_id=None, cuda_aware=None):
        import cupy
        self.xp = cupy
        self.device = cupy.cuda.Device(device_id)
        with self.device:
            self.stream = cupy.cuda.Stream(non_blocking=False)
            self.copy_stream = cupy.cuda.Stream(non_blocking=False)
        if cuda_aware is None:
            from ..runtime.device import resolve_cuda_aware
            cuda_aware = resolve_cuda_aware()[0]
        self.cuda_aware = bool(cuda_aware)
        self._uploads: OrderedDict = OrderedDict()
        self._messages: "weakref.WeakSet[DeviceMessage]" = weakref.WeakSet()

    # ------------------------------------------------------------ arrays
    @staticmethod
    def compute_dtype(dtype) -> np.dtype:
        return compute_dtype(dtype)

    def asarray(self, x):
        with self.device:
            return self.xp.asarray(x)

    @contextlib.contextmanager
    def _on_stream(self):
        """Run the body on the compute stream, ordered after the work queued on
        the caller's current stream; afterwards the caller's stream waits for
        the compute stream."""
        with self.device:
            caller = self.xp.cuda.get_current_stream()
            same = caller.ptr == self.stream.ptr
            if not same:
                self.stream.wait_event(caller.record())
            with self.stream:
                yield
            if not same:
                caller.wait_event(self.stream.record())

    def _convert(self, x, out_dtype, copy=False):
        """Contiguous ``x`` in ``out_dtype`` (bfloat16-aware); a new array
        when the dtype changes or ``copy`` is true."""
        cp = self.xp
        if not isinstance(out_dtype, str) and np.dtype(x.dtype) == np.dtype(out_dtype):
            # the same dtype, of any kind (invariant=True's int64 sums cross head x ring so)
            return cp.array(x, order="C", copy=True) if copy else cp.ascontiguousarray(x)
        in_kind, out_kind = _kind_of_dtype(x.dtype), _kind_of_dtype(out_dtype)
        if in_kind == out_kind:
            return cp.array(x, order="C", copy=True) if copy else cp.ascontiguousarray(x)
        if K.BF16 not in (in_kind, out_kind):
            return cp.ascontiguousarray(x, dtype=storage_dtype(out_dtype))
        x = cp.ascontiguousarray(x)
        out = cp.empty(x.shape, dtype=storage_dtype(out_dtype))
        if x.size:
            kern = self._kernel(*K.convert_kernel(in_kind, out_kind))
            kern((_grid_1d(x.size),), (_THREADS_1D,), (x, out, np.int64(x.size)))
        return out

    def to_heads(self, x, dtype):
        """``(B, S, H, D)`` -> contiguous ``(B, H, S, D)`` in ``dtype`` (rounded once, to nearest even)."""
        with self._on_stream():
            return self._convert(self.asarray(x).transpose(0, 2, 1, 3), dtype, copy=True)

    def heads_view(self, x, dtype):
        """The block ops' read-only ``(B, H, S, D)`` operand: the kernels need it contiguous, so
        :meth:`to_heads`' copy."""
        return self.to_heads(x, dtype)

    def from_heads(self, xh, dtype):
        """``(B, H, S, D)`` -> new contiguous ``(B, S, H, D)`` in ``dtype``."""
        with self._on_stream():
            return self._convert(self.asarray(xh).transpose(0, 2, 1, 3), dtype, copy=True)

    def row_dot(self, x, y):
        """``(x * y).sum(-1)`` of two ``(B, H, S, D)`` compute-dtype arrays:
        the backward's ``dvec = rowsum(do * o)``, as ``(B, H, S)``."""
        cp = self.xp
        with self._on_stream():
            ct = self.compute_dtype(x.dtype)
            x = cp.ascontiguousarray(x, dtype=ct)
            y = cp.ascontiguousarray(y, dtype=ct)
            out = cp.empty(x.shape[:-1], dtype=ct)
            rows, d = int(np.prod(x.shape[:-1])), int(x.shape[-1])
            if rows and d:
                kern = self._kernel(*K.rowdot_kernel(_kind_of_dtype(ct)))
                warps_per_block = _THREADS_1D // 32
                grid = max(1, min((rows + warps_per_block - 1) // warps_per_block, 65535 * 8))
                kern((grid,), (_THREADS_1D,), (x, y, out, np.int64(rows), np.int32(d)))
            elif rows:
                out.fill(0)
            return out

    # ------------------------------------------------------------ messages
    def message(self, nbytes: int) -> "DeviceMessage":
        msg = DeviceMessage(self, nbytes, self.cuda_aware)
        self._messages.add(msg)
        return msg

    def synchronize(self, tick=None) -> None:
        """Wait for all queued work; with ``tick``, keep MPI progressing meanwhile."""
        with self.device:
            events = []
            for stream in (self.stream, self.copy_stream, self.xp.cuda.get_current_stream()):
                event = self.xp.cuda.Event(disable_timing=True)
                event.record(stream)
                events.append(event)
        if tick is not None:
            while not all(event.done for event in events):
                tick()
                time.sleep(2e-5)
        for event in events:
            event.synchronize()

    @staticmethod
    def annotate(name: str):
        """An NVTX range (visible in Nsight Systems) around host code."""
        from ..runtime.device import nvtx_range
        return nvtx_range(name)

    # ------------------------------------------------------------ kernel choice
    def block_kernel(self, direction: str, dtype, d: int, d_v=None) -> "K.BlockKernel":
        """The ``"forward"`` or ``"backward"`` kernel for K/V ``dtype``, head dim ``d`` and
        value head dim ``d_v`` on this device (its compute capability and opt-in shared
        memory per block); ConfigError when none fits."""
        plan = K.forward_kernel if direction == "forward" else K.backward_kernel
        dev = self.device.id
        return plan(_kind_of_dtype(dtype), d, smem_optin_limit(dev), d_v=d_v, cc=compute_capability(dev))

    def kernel_problem(self, dtype, d: int, d_v=None):
        """Why this device has no forward or backward kernel for ``dtype``, ``d``, ``d_v``, or None."""
        from ..runtime.errors import ConfigError
        try:
            for direction in ("forward", "backward"):
                self.block_kernel(direction, dtype, d, d_v)
        except ConfigError as exc:
            return str(exc)
        return None

    # ------------------------------------------------------------ helpers
    def _kernel(self, filename, expr, smem=0):
        return K.get_kernel(filename, expr, self.device.id, int(smem))

    def _upload(self, host: np.ndarray, tile=None, seg=None):
        """``(host int64 data, device copy)`` of a host array (or of its tile
        bounds when ``tile`` is given), cached by content."""
        h = hashlib.blake2b(digest_size=16)
        h.update(np.ascontiguousarray(host, dtype=np.int64).tobytes())
        if seg is not None:
            h.update(np.ascontiguousarray(seg, dtype=np.int64).tobytes())
            h.update(repr(np.shape(seg)).encode())
        key = (h.digest(), len(host), tile, seg is not None)
        hit = self._uploads.get(key)
        if hit is not None:
            self._uploads.move_to_end(key)
            return hit
        data = tile_bounds(host, seg, tile) if tile is not None else np.ascontiguousarray(host, dtype=np.int64)
        with self.device:
            dev = self.xp.asarray(data)
        self._uploads[key] = (data, dev)
        while len(self._uploads) > 64:
            self._uploads.popitem(last=False)
        return data, dev

    def _mask_args(self, mask: BlockMask, batch: int, kernel: "K.BlockKernel", sq: int, skv: int):
        """The kernel's ``MASK_PARAMS`` and ``MOD_PARAMS`` values and the block's ``(tiles computed,
        tiles skipped)``, counted as the kernel classifies them."""
        seg_q, seg_kv = _segments(mask, batch)
        has_seg = seg_q is not None
        (bm, bn), (nqt, nkt) = kernel.tiles, kernel.tile_counts(sq, skv)
        q_bounds, dq_bounds = self._upload(mask.q_pos, bm, seg_q)
        kv_bounds, dkv_bounds = self._upload(mask.kv_pos, bn, seg_kv)
        classes = classify_tiles(mask.spec, q_bounds, kv_bounds, nqt, nkt, batch, has_seg)
        return self._mask_values(mask, batch, (dq_bounds, dkv_bounds)), tile_counts(classes, has_seg, batch)

    def _mask_values(self, mask: BlockMask, batch: int, bounds=None) -> tuple:
        """The kernels' ``MASK_PARAMS`` and ``MOD_PARAMS`` values of ``mask``; ``bounds``: the
        device ``(q_bounds, kv_bounds)`` of the kernel's tiles, or None for a kernel that
        classifies no tile (invariant.cu: the positions array stands in, never read)."""
        seg_q, seg_kv = _segments(mask, batch)
        has_seg = seg_q is not None
        q_pos = self._upload(mask.q_pos)[1]
        kv_pos = self._upload(mask.kv_pos)[1]
        if has_seg:
            dseg_q, dseg_kv = self._upload(seg_q.ravel())[1], self._upload(seg_kv.ravel())[1]
        else:
            dseg_q, dseg_kv = q_pos, kv_pos  # never read: has_seg = 0
        dq_bounds, dkv_bounds = (q_pos, kv_pos) if bounds is None else bounds
        has_lo, lo_delta, has_hi, hi_delta = mask_scalars(mask.spec)
        return ((q_pos, kv_pos, dseg_q, dseg_kv, dq_bounds, dkv_bounds,
                 np.int32(has_seg), has_lo, lo_delta, has_hi, hi_delta)
                + modifier_scalars(mask.spec) + self._modifier_args(mask.spec, q_pos))

    def _modifier_args(self, spec, dummy):
        """The per-head modifiers' ``MOD_PARAMS`` values after the softcap: the bits of the modifiers
        on, their ``(H, MAX_HEAD_MODS)`` float32 values (device; the device array ``dummy`` when none
        is on, never read) and ``N_kv - N_q``."""
        if not spec.modifiers:
            return np.int32(0), dummy, np.int64(0)
        key = ("head_values",) + tuple((kernel_index(m), m.values) for m in spec.modifiers)
        if key not in self._uploads:
            heads = len(spec.modifiers[0].values)
            values = np.zeros((heads, MAX_KERNEL_MODIFIERS), dtype=np.float32)
            for m in spec.modifiers:
                values[:, kernel_index(m)] = m.kernel_values()
            with self.device:
                self._uploads[key] = (None, self.xp.asarray(values))
        bits = sum(1 << kernel_index(m) for m in spec.modifiers)
        return np.int32(bits), self._uploads[key][1], np.int64(spec.offset)

    def _kv_operand(self, x, ct):
        """K/V as a contiguous array the kernels for compute dtype ``ct`` read."""
        kind = _kind_of_dtype(x.dtype)
        if ct == np.float64:
            return self._convert(x, np.float64) if kind != K.F64 else self.xp.ascontiguousarray(x)
        if kind == K.F64:
            return self._convert(x, np.float32)
        return self.xp.ascontiguousarray(x)

    @staticmethod
    def _check_state(name, x, shape, dtype):
        if tuple(x.shape) != tuple(shape) or x.dtype != dtype or not x.flags.c_contiguous:
            raise ValueError(f"{name} must be a C-contiguous {np.dtype(dtype)} array of shape "
                             f"{tuple(shape)}, got {x.dtype} {tuple(x.shape)}")

    def _mark_use(self, *arrays):
        """Record that the compute stream used these buffers (for messages)."""
        ev = self.stream.record()
        for msg in list(self._messages):
            if any(msg.contains(a) for a in arrays):
                msg.compute_used(ev)

    # ------------------------------------------------------------ forward
    def forward_block(self, qh, kh, vh, o_acc, m, l, scale, mask: BlockMask, tick=None, resident=None):
        """See :mod:`ringmpi.backends`; all arrays are CuPy arrays on this device
        (``resident`` is not needed: the kernels read the resident arrays in place)."""
        batch, heads, sq, d = qh.shape
        kv_heads, skv = kh.shape[1], kh.shape[2]
        d_v = vh.shape[3]
        if _nothing_to_do(batch, heads, kv_heads, sq, skv, tick):
            return 0, 0
        ct = self.compute_dtype(qh.dtype)
        with self._on_stream():
            qh = self.xp.ascontiguousarray(qh, dtype=ct)
            used = (kh, vh)
            kh, vh = self._kv_operand(kh, ct), self._kv_operand(vh, ct)
            self._check_state("o_acc", o_acc, (batch, heads, sq, d_v), ct)
            self._check_state("m", m, (batch, heads, sq), ct)
            self._check_state("l", l, (batch, heads, sq), ct)
            kind = _kind_of_dtype(kh.dtype)
            kernel = self.block_kernel("forward", kh.dtype, d, d_v)
            if kind in (K.F16, K.BF16) and not kernel.tensor_cores:
                # the SIMT kernel multiplies qh as given: round it as the MMA kernel does
                qh = self._convert(self._convert(qh, kh.dtype), ct)
            margs, counts = self._mask_args(mask, batch, kernel, sq, skv)
            margs += _dropout_args(mask, ct)
            smem = kernel.shared_mem_bytes()
            self._kernel(kernel.filename, kernel.expr, smem)(
                kernel.grid(batch, heads, kv_heads, sq, skv), kernel.block(),
                kernel.args((qh, kh, vh, o_acc, m, l), ct.type(scale), margs,
                            batch, heads, kv_heads, sq, skv, d, d_v),
                shared_mem=smem)
            self._mark_use(*used)
        if tick is not None:
            tick()
        return counts

    def finalize(self, o_acc, m, l, out_dtype):
        """``o (B, Sq, H, D)`` in ``out_dtype`` and
        ``lse (B, H, Sq)`` in the compute dtype."""
        cp = self.xp
        batch, heads, sq, d = o_acc.shape
        ct = o_acc.dtype
        with self._on_stream():
            o = cp.empty((batch, sq, heads, d), dtype=storage_dtype(out_dtype))
            lse = cp.empty((batch, heads, sq), dtype=ct)
            if o_acc.size:
                o_acc, m, l = (cp.ascontiguousarray(x) for x in (o_acc, m, l))
                kern = self._kernel(*K.finalize_kernel(_kind_of_dtype(ct), _kind_of_dtype(out_dtype)))
                kern((_grid_1d(o_acc.size),), (_THREADS_1D,),
                     (o_acc, m, l, o, lse, np.int32(batch), np.int32(heads), np.int32(sq), np.int32(d)))
            elif lse.size:
                # d == 0: no output elements to carry the lse
                lse[...] = cp.where(l > 0, m + cp.log(cp.where(l > 0, l, 1)), -cp.inf)
            return o, lse

    # ------------------------------------------------------------ backward
    def backward_block(self, qh, doh, lse, dvec, kh, vh, dq, dk, dv, scale, mask: BlockMask, tick=None,
                       resident=None):
        """See :mod:`ringmpi.backends`; all arrays are CuPy arrays on this device
        (``resident`` is not needed: the kernels read the resident arrays in place)."""
        batch, heads, sq, d = qh.shape
        kv_heads, skv = kh.shape[1], kh.shape[2]
        d_v = vh.shape[3]
        if _nothing_to_do(batch, heads, kv_heads, sq, skv, tick):
            return 0, 0
        ct = self.compute_dtype(qh.dtype)
        cp = self.xp
        with self._on_stream():
            qh, doh, lse, dvec = (cp.ascontiguousarray(x, dtype=ct) for x in (qh, doh, lse, dvec))
            used = (kh, vh, dk, dv)
            kh, vh = self._kv_operand(kh, ct), self._kv_operand(vh, ct)
            self._check_state("dq", dq, (batch, heads, sq, d), ct)
            self._check_state("dk", dk, (batch, kv_heads, skv, d), ct)
            self._check_state("dv", dv, (batch, kv_heads, skv, d_v), ct)
            kind = _kind_of_dtype(kh.dtype)
            kernel = self.block_kernel("backward", kh.dtype, d, d_v)
            if kind in (K.F16, K.BF16) and not kernel.tensor_cores:
                # the SIMT kernel multiplies qh/doh as given: round them as the MMA kernels do
                qh, doh = (self._convert(self._convert(x, kh.dtype), ct) for x in (qh, doh))
            margs, counts = self._mask_args(mask, batch, kernel, sq, skv)
            margs += _dropout_args(mask, ct)
            smem = kernel.shared_mem_bytes()
            self._kernel(kernel.filename, kernel.expr, smem)(
                kernel.grid(batch, heads, kv_heads, sq, skv), kernel.block(),
                kernel.args((qh, doh, lse, dvec, kh, vh, dq, dk, dv, kernel.dq_turns(batch, heads, sq, skv, cp)),
                            ct.type(scale), margs,
                            batch, heads, kv_heads, sq, skv, d, d_v),
                shared_mem=smem)
            self._mark_use(*used)
        if tick is not None:
            tick()
        return counts


    # ----------------------------------------------------------- invariant=True
    # the block ops of the invariant mode on the GPU: ringmpi.backends.invariant_device
    # (invariant.cu), driven by ringmpi.parallel.invariant_passes as the NumPy ones are
    def invariant_resident(self, qh, positions, seg, kv_dtype, ct, spec, do=None, lse=None, dvec=None):
        """The call's resident rows (:class:`ringmpi.backends.invariant_device.DeviceResident`)."""
        from .invariant_device import DeviceResident
        return DeviceResident(self, qh, positions, seg, kv_dtype, ct, spec, do=do, lse=lse, dvec=dvec)

    @staticmethod
    def invariant_max_block(*args, **kwargs):
        """:func:`ringmpi.backends.invariant_device.max_block`."""
        from .invariant_device import max_block
        return max_block(*args, **kwargs)

    @staticmethod
    def invariant_forward_block(*args, **kwargs):
        """:func:`ringmpi.backends.invariant_device.forward_block`."""
        from .invariant_device import forward_block
        return forward_block(*args, **kwargs)

    @staticmethod
    def invariant_backward_block(*args, **kwargs):
        """:func:`ringmpi.backends.invariant_device.backward_block`."""
        from .invariant_device import backward_block
        return backward_block(*args, **kwargs)


class DeviceMessage:
    """A ring message buffer on the GPU (interface of
    :class:`ringmpi.backends.HostMessage`).

    CUDA-aware mode: ``mpi_buffer()`` is the device buffer itself.  Staged
    mode: it is a pinned host buffer and the compute side a device buffer;
    ``arrived()`` copies host -> device asynchronously (the compute stream
    waits on it), ``ready_to_send(True)`` copies device -> host.

    ``mpi_buffer()`` blocks: it waits until no queued GPU work still reads
    or writes the memory MPI is about to use, so a buffer handed to
    ``Irecv`` is never overwritten under a running kernel or copy.
    """

    def __init__(self, backend: CupyBackend, nbytes: int, cuda_aware: bool):
        import cupy
        import cupyx
        self._backend = backend
        n = max(int(nbytes), 1)
        with backend.device:
            self._dev = cupy.empty(n, dtype=np.uint8)
        self._host = None if cuda_aware else cupyx.empty_pinned((n,), dtype=np.uint8)
        self._compute_event = None  # last compute-stream use of the device buffer
        self._copy_event = None     # last H2D copy reading the pinned buffer
        lo = self._dev.data.ptr
        self._range = (lo, lo + n)

    @property
    def cuda_aware(self) -> bool:
        """True when MPI reads and writes the device buffer itself (no pinned staging buffer)."""
        return self._host is None

    def mpi_buffer(self):
        """The buffer to hand to ``Isend``/``Irecv``, after waiting for the GPU
        work that still uses its memory."""
        if self.cuda_aware:
            if self._compute_event is not None:
                self._compute_event.synchronize()
            return self._dev
        if self._copy_event is not None:
            self._copy_event.synchronize()
        return self._host

    def contains(self, arr) -> bool:
        ptr = arr.data.ptr
        return self._range[0] <= ptr < self._range[1]

    def compute_used(self, event) -> None:
        self._compute_event = event

    def view(self, offset: int, shape, dtype):
        dtype = np.dtype(dtype)  # any dtype, as HostMessage.view (ml_dtypes' bfloat16 included)
        count = int(np.prod(shape, dtype=np.int64))
        return self._dev[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)

    def arrived(self) -> None:
        if self.cuda_aware:
            return
        import cupy
        be = self._backend
        with be.device:
            if self._compute_event is not None:
                be.copy_stream.wait_event(self._compute_event)
            self._dev.set(self._host, stream=be.copy_stream)
            self._copy_event = be.copy_stream.record()
            be.stream.wait_event(self._copy_event)
            cupy.cuda.get_current_stream().wait_event(self._copy_event)

    def ready_to_send(self, dirty: bool) -> None:
        if not dirty:
            return
        import cupy
        be = self._backend
        with be.device:
            # writes may come from the compute stream or the caller's stream
            produced = [be.stream.record(), cupy.cuda.get_current_stream().record()]
            if self.cuda_aware:
                for ev in produced:
                    ev.synchronize()
                return
            for ev in produced:
                be.copy_stream.wait_event(ev)
            self._dev.get(stream=be.copy_stream, out=self._host)
            be.copy_stream.synchronize()
