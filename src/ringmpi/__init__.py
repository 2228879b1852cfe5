"""ringmpi: exact attention over sequences sharded across MPI ranks.

Each rank keeps its queries; key/value blocks travel around a ring of ranks
and are folded into an online-softmax accumulator.  Importing this package
does not initialise MPI or touch a GPU.
"""

import os as _os

__version__ = "0.1.0"

# One BLAS/OpenMP thread per rank by default: parallelism comes from MPI ranks.
# Takes effect when ringmpi is imported before NumPy; set the variables to override.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    _os.environ.setdefault(_var, "1")

from .layout import Layout  # noqa: E402
from .attention import ring_attention, ring_attention_backward  # noqa: E402
from .errors import ConfigError, RingTimeout, abort_on_error  # noqa: E402
from .decode import decode_attention  # noqa: E402
from .kvcache import KVCache  # noqa: E402

__all__ = ["Layout", "ring_attention", "ring_attention_backward", "decode_attention", "KVCache", "abort_on_error",
           "ConfigError", "RingTimeout", "__version__"]
