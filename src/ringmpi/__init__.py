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
import importlib.abc as _abc
import importlib.util as _util
import sys as _sys

__version__ = "0.1.0"

_PUBLIC = {
    "Layout": "core.layout",
    "ring_attention": "attention",
    "ring_attention_backward": "attention",
    "ConfigError": "runtime.errors",
    "RingTimeout": "runtime.errors",
    "abort_on_error": "runtime.errors",
    "decode_attention": "decode",
    "KVCache": "kvcache",
    "RingContext": "context",
    "Attention": "context",
    "Gradients": "context",
    "gated_delta_rule": "linear_attention",
    "gated_delta_rule_backward": "linear_attention",
    "simple_gla": "linear_attention",
    "simple_gla_backward": "linear_attention",
    "kda": "linear_attention",
    "kda_backward": "linear_attention",
    "gla": "linear_attention",
    "gla_backward": "linear_attention",
    "causal_conv1d": "causal_conv",
    "causal_conv1d_backward": "causal_conv",
    "relayout": "relayout",
}

# documented public modules that live in a layer's folder: the old path is the same module object
_MODULES = {
    "ringmpi.dtypes": "ringmpi.core.dtypes",      # float64_to_bfloat16, the bfloat16 dtype
    "ringmpi.device": "ringmpi.runtime.device",   # select_device(comm)
}


class _PublicModules(_abc.MetaPathFinder, _abc.Loader):
    """Finds the documented paths of :data:`_MODULES`; the module is imported only when asked for."""

    def find_spec(self, name, path=None, target=None):
        return _util.spec_from_loader(name, self) if name in _MODULES else None

    def create_module(self, spec):
        return _importlib.import_module(_MODULES[spec.name])

    def exec_module(self, module):
        pass


if not any(isinstance(f, _PublicModules) for f in _sys.meta_path):
    _sys.meta_path.insert(0, _PublicModules())

__all__ = ["Layout", "ring_attention", "ring_attention_backward", "decode_attention", "KVCache",
           "RingContext", "Attention", "Gradients",
           "gated_delta_rule", "gated_delta_rule_backward", "simple_gla", "simple_gla_backward",
           "kda", "kda_backward", "gla", "gla_backward",
           "causal_conv1d", "causal_conv1d_backward", "relayout",
           "abort_on_error", "ConfigError", "RingTimeout", "__version__"]


def __getattr__(name):
    if f"{__name__}.{name}" in _MODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    if name in _PUBLIC:
        value = getattr(_importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ringmpi' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
