"""The Ascend gate: every kernel of ``triton_kernels`` through triton-ascend's lowering and BiSheng's memory
planning, offline (docs/ascend-gate.md). Tooling, not runtime: nothing the server imports imports it, and
its lowering needs triton-ascend, in a venv of its own (``.ci/ascend_gate.sh``)."""

import os


def rel_path(path: str) -> str:
    """``path`` relative to the working directory when it lies below it (messages name repository files)."""
    return os.path.relpath(path) if os.path.abspath(path).startswith(os.getcwd() + os.sep) else path
