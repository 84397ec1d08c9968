"""Shared pytest set-up for tests/ and proofs/.

- Hypothesis profiles: ``ci`` (derandomised, no deadline, few examples: keeps the suite within
  minutes on 2 cores) is chosen automatically when ``CI`` is set; ``dev`` otherwise; ``thorough``
  on request. Override with ``STREAMKL_HYPOTHESIS_PROFILE=<name>``.
- Triton: with no NVIDIA GPU on the machine, the kernels run under the Triton interpreter on CPU.
  The variable must be set before any module that defines a kernel is imported, so it is set here.
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
