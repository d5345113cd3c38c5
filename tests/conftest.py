"""Test-session setup shared by every test package."""

import os

# Triton reads TRITON_INTERPRET when a kernel is decorated, so it must be set before any test
# module imports triton_kernels: kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"
# The operators' own index-range checks (a device-to-host read each) are a debug switch, read once:
# on for every test, so invalid inputs are refused by the op itself.
os.environ.setdefault("DSV4_CHECK_RANGES", "1")
