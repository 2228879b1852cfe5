"""torch's ``scaled_dot_product_attention`` on the shapes ringmpi benchmarks: the comparison column.

:func:`measure_sdpa` times SDPA in a child process (importing torch into a
benchmark process changes NumPy's BLAS threading and slows it by several
times) on ``(B, H, N, D)`` standard-normal inputs, K/V expanded to ``H`` heads
outside the timed region for GQA.  :func:`flash_sdpa_cuda_seconds` times
torch's flash backend in-process on a GPU (CUDA events), for the GPU kernel
benchmark.  The FLOP count is :func:`ringmpi.core.flops.attention_flops`.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from typing import Optional, Tuple

INSTALL = "pip install 'ringmpi[bench]'"

_SCRIPT = r"""
import json, sys, time, statistics
import torch
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
dev = cfg["device"]
dt = getattr(torch, cfg["dtype"])
b, h, hkv, n, d = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["n"], cfg["dim"]
g = torch.Generator(device="cpu").manual_seed(0)
dv = cfg.get("dim_v") or d
mk = lambda heads, width=d: torch.randn(b, heads, n, width, generator=g).to(device=dev, dtype=dt)
q, k, v, do = mk(h), mk(hkv), mk(hkv, dv), mk(h, dv)
if hkv != h:  # expand once, outside the timed region
    k, v = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
sdpa = torch.nn.functional.scaled_dot_product_attention
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
def timed(fn):
    out = []
    for i in range(cfg["warmup"] + cfg["repeat"]):
        sync(); t = time.perf_counter(); fn(); sync()
        if i >= cfg["warmup"]:
            out.append(time.perf_counter() - t)
    return min(out) if cfg["statistic"] == "min" else statistics.median(out)
res = {"torch_version": torch.__version__, "threads": torch.get_num_threads(), "device": dev}
with torch.no_grad():
    res["forward_seconds"] = timed(lambda: sdpa(q, k, v, is_causal=cfg["causal"]))
if cfg["backward"]:
    rq, rk, rv = (x.clone().requires_grad_() for x in (q, k, v))
    ro = sdpa(rq, rk, rv, is_causal=cfg["causal"])
    res["backward_seconds"] = timed(lambda: torch.autograd.grad(ro, (rq, rk, rv), do, retain_graph=True))
print("TORCH_SDPA " + json.dumps(res))
"""


def measure_sdpa(batch: int, heads: int, kv_heads: int, n: int, dim: int, dtype: str, causal: bool,
                 backward: bool, warmup: int, repeat: int, threads: int, device: str = "cpu",
                 statistic: str = "median", timeout: float = 3600.0, dim_v: Optional[int] = None) -> dict:
    """Seconds of SDPA forward (and backward) over ``repeat`` timed calls after ``warmup``.

    ``dim_v``: the value head dim (default ``dim``).

    ``statistic`` is ``"median"`` or ``"min"`` over the timed calls; ``device``
    ``"cpu"`` (``threads`` torch threads) or ``"cuda"``.  Returns
    ``{"available": True, "forward_seconds", ["backward_seconds"], "torch_version",
    "threads", "device"}``, or ``{"available": False, "reason"}`` without torch
    or when the child fails.
    """
    if importlib.util.find_spec("torch") is None:
        return {"available": False, "reason": f"torch is not importable ({INSTALL})"}
    cfg = dict(batch=batch, heads=heads, kv_heads=kv_heads, n=n, dim=dim, dtype=dtype, causal=bool(causal),
               backward=bool(backward), warmup=warmup, repeat=repeat, threads=threads, device=device,
               statistic=statistic, dim_v=dim_v)
    env = None
    if device == "cpu":
        import os
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    try:
        proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(cfg)],
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"available": False, "reason": "torch SDPA measurement timed out"}
    for line in proc.stdout.splitlines():
        if line.startswith("TORCH_SDPA "):
            return {"available": True, **json.loads(line[len("TORCH_SDPA "):])}
    return {"available": False, "reason": f"torch SDPA failed: {proc.stderr.strip()[-500:]}"}


def flash_sdpa_cuda_seconds(batch: int, heads: int, seqlen: int, dim: int, causal: bool,
                            repeats: int, dtype: str = "bfloat16") -> Optional[Tuple[float, float]]:
    """(forward, backward) seconds of torch's flash SDPA in ``dtype`` (bfloat16 or float16)
    on this GPU, or None.

    Mean over ``repeats`` calls after one warm-up, timed with CUDA events;
    backward is (forward + backward) minus forward.
    """
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception:
        return None
    if not torch.cuda.is_available():
        return None
    shape = (batch, heads, seqlen, dim)
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=dt)
    f = torch.nn.functional.scaled_dot_product_attention

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop) / 1e3 / repeats

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        with torch.no_grad():
            t_fwd = timed(lambda: f(q, k, v, is_causal=causal))
        out = f(q, k, v, is_causal=causal)
        t_both = timed(lambda: torch.autograd.grad(f(q, k, v, is_causal=causal), (q, k, v), do))
    del out
    return t_fwd, max(t_both - t_fwd, 1e-9)
