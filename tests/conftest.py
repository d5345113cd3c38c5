"""Test-session setup shared by every test package."""

import os

# Triton reads TRITON_INTERPRET when a kernel is decorated, so it must be set before any test
# module imports triton_kernels: kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"
# The operators' own index-range checks (a device-to-host read each) are a debug switch, read once:
# on for every test, so invalid inputs are refused by the op itself.
os.environ.setdefault("DSV4_CHECK_RANGES", "1")
# Under pytest-xdist the cores are shared by the workers: one OpenMP pool per worker sized to its share
# (through the environment, so the servers and ranks a test starts run on the same thread count).
if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(workers))))
