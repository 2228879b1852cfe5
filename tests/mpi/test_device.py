"""No GPU where one was asked for: ``--backend cupy`` stops before any data
moves with one message naming the cause, exit 2, printed once; ``ringmpi info``
names the same cause.  Run for real where CuPy is installed and no GPU is
usable (this project's CI); the causes that need other hardware (a driver too
old for CuPy's CUDA runtime, no device visible) are checked on the sentence
CUDA's error turns into."""

import subprocess
import sys

import pytest

from cli_util import RINGMPI, write_input
from mpi_util import ROOT, mpirun, mpirun_env
from ringmpi.runtime.device import cuda_error_reason, gpu_unavailable_reason

REASON = gpu_unavailable_reason()
needs_no_gpu = pytest.mark.skipif(REASON is None, reason="this machine has a usable GPU: nothing to refuse")


@needs_no_gpu
@pytest.mark.mpi
@pytest.mark.parametrize("command", ["run", "bench"])
def test_backend_cupy_without_gpu_exits_2_once(tmp_path, command):
    src = write_input(tmp_path / "in.h5")
    out = tmp_path / "out.h5"
    args = (["run", src, "-o", out, "--causal"] if command == "run"
            else ["bench", "--n", "64", "--heads", "2", "--dim", "8", "--repeat", "1", "--json", out])
    rc, stdout, stderr, _ = mpirun(2, [RINGMPI, *args, "--backend", "cupy"], 60)
    assert rc == 2, stderr
    message = f"ringmpi: error: --backend cupy needs a usable CUDA GPU, but {REASON}"
    assert stderr.count("ringmpi: error:") == 1 and message in stderr, stderr
    assert "Traceback" not in stderr and "MPI_ABORT" not in stderr.upper(), stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in.h5"]


@needs_no_gpu
@pytest.mark.mpi
def test_info_names_the_cause():
    rc, out, err, _ = mpirun(2, [RINGMPI, "info"], 60)
    assert rc == 0, err
    assert f"GPUs seen by rank 0: 0 [none]; {REASON}" in out and "backend 'auto' picks: numpy" in out, out


def test_cupy_missing_is_named(tmp_path):
    """One process where ``import cupy`` fails (as when it is not installed): exit 2, the cause named."""
    src = write_input(tmp_path / "in.h5")
    code = ("import sys\nsys.modules['cupy'] = None  # import cupy fails as when not installed\n"
            "from ringmpi.cli import main\nmain()\n")
    proc = subprocess.run([sys.executable, "-c", code, "run", str(src), "-o", str(tmp_path / "out.h5"),
                           "--backend", "cupy"], capture_output=True, text=True, timeout=60, env=mpirun_env(),
                          cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("ringmpi: error:") == 1, proc.stderr
    assert "--backend cupy needs a usable CUDA GPU, but CuPy is not importable (ModuleNotFoundError" in proc.stderr
    assert "RINGMPI_EXTRAS=gpu scripts/setup.sh" in proc.stderr
    assert not (tmp_path / "out.h5").exists()


INSUFFICIENT = "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version"


@pytest.mark.parametrize("error, driver, runtime, visible, expected", [
    (INSUFFICIENT, 0, 12090, None, f"no NVIDIA driver is loaded on this node, so CUDA sees no GPU ({INSUFFICIENT})"),
    (INSUFFICIENT, 11040, 12090, None,
     f"the NVIDIA driver is too old: it supports CUDA 11.4, CuPy's CUDA runtime is 12.9 ({INSUFFICIENT}); "
     "update the driver or install the CuPy build for CUDA 11 (cupy-cuda11x)"),
    ("cudaErrorNoDevice: no CUDA-capable device is detected", 12040, 12090, "",
     "no CUDA device is visible to this process with CUDA_VISIBLE_DEVICES='' "
     "(cudaErrorNoDevice: no CUDA-capable device is detected)"),
    ("cudaErrorNoDevice: no CUDA-capable device is detected", 12040, 12090, None,
     "no CUDA device is visible to this process (cudaErrorNoDevice: no CUDA-capable device is detected)"),
    ("cudaErrorDevicesUnavailable: CUDA-capable device(s) is/are busy or unavailable", 12040, 12090, None,
     "CUDA cannot use a device (cudaErrorDevicesUnavailable: CUDA-capable device(s) is/are busy or unavailable)"),
], ids=["no-driver", "driver-too-old", "no-device-masked", "no-device", "busy"])
def test_cuda_error_reason(error, driver, runtime, visible, expected):
    assert cuda_error_reason(error, driver, runtime, visible) == expected


def test_a_gpu_below_sm70_is_unusable_and_named():
    """The kernels need compute capability 7.0: an older device is named with its
    capability (``gpu_unavailable_reason`` asks this of every visible device)."""
    from ringmpi.runtime.device import capability_reason

    assert capability_reason([(0, "Tesla V100-SXM2-16GB", 7, 0), (1, "Tesla T4", 7, 5)]) is None
    assert capability_reason([(0, "NVIDIA H100 80GB HBM3", 9, 0)]) is None
    reason = capability_reason([(0, "Tesla T4", 7, 5), (1, "Tesla P100-PCIE-16GB", 6, 0)])
    assert reason == ("device 1 (Tesla P100-PCIE-16GB) has compute capability 6.0; ringmpi's CUDA kernels "
                      "need compute capability 7.0 (Volta) or newer (use backend numpy, or "
                      "CUDA_VISIBLE_DEVICES to hide that device)")
