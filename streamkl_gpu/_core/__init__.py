"""Shared machinery of every kernel: runtime facts, input checks, the launch tuner and its disk
cache, the one launcher cache, backend selection, environment variables, the forcing hook and the
shared ``@triton.jit`` helpers. Nothing here imports a kernel module (tests/test_layout.py)."""
