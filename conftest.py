"""Shared pytest set-up for tests/ and proofs/.

- Hypothesis profiles: ``ci`` (derandomised, no deadline, few examples: keeps the suite within
  minutes on 2 cores) is chosen automatically when ``CI`` is set; ``dev`` otherwise; ``thorough``
  on request. Override with ``STREAMKL_HYPOTHESIS_PROFILE=<name>``.
- Triton: with no NVIDIA GPU on the machine, the kernels run under the Triton interpreter on CPU.
  The variable must be set before any module that defines a kernel is imported, so it is set here.
- Threads: under pytest-xdist (``make test``: 2 workers) each worker, and each process a test
  starts, gets ``cores // workers`` torch threads (``OMP_NUM_THREADS``, unless it is set): torch's
  default of one per core made every process beside the other worker spin a thread for CPU that
  worker needed (measured: tests/test_conformance_streaming.py 19.6 CPU-s on 2 threads against
  12.4 on 1, in the same 12 s).
"""
import os
import shutil

from hypothesis import settings

from streamkl_ref.strategies import register_profiles

# one home for the profiles (streamkl_ref.strategies.PROFILES); registered here under their plain names
register_profiles(prefix="")
settings.load_profile(
    os.environ.get("STREAMKL_HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)

if "TRITON_INTERPRET" not in os.environ and shutil.which("nvidia-smi") is None:
    os.environ["TRITON_INTERPRET"] = "1"

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
if _workers > 1 and "OMP_NUM_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores // _workers))  # before torch starts its pool
