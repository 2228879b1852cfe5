"""ringmpi: exact attention over sequences sharded across MPI ranks.

Each rank keeps its queries; key/value blocks travel around a ring of ranks
and are folded into an online-softmax accumulator.  Importing this package
does not initialise MPI, touch a GPU, import NumPy or change the environment:
the public names below load on first use.

Parallelism comes from MPI ranks, so each rank should use one BLAS thread.
The ``ringmpi`` command sets that itself; a library user sets
``OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1`` before NumPy
is first imported (in the job script, or ``os.environ`` at the top of the
program).  See docs/design.md.
"""

import importlib as _importlib

__version__ = "0.1.0"

_PUBLIC = {
    "Layout": "layout",
    "ring_attention": "attention",
    "ring_attention_backward": "attention",
    "ConfigError": "errors",
    "RingTimeout": "errors",
    "abort_on_error": "errors",
    "decode_attention": "decode",
    "KVCache": "kvcache",
    "AttentionOptions": "options",
}

__all__ = ["Layout", "ring_attention", "ring_attention_backward", "decode_attention", "KVCache", "AttentionOptions",
           "abort_on_error", "ConfigError", "RingTimeout", "__version__"]


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(_importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ringmpi' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
