"""Test-session setup shared by every test package."""

import math
import os
from pathlib import Path

# Triton reads TRITON_INTERPRET when a kernel is decorated, so it must be set before any test
# module imports triton_kernels: kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"
# The operators' own index-range checks (a device-to-host read each) are a debug switch, read once:
# on for every test, so invalid inputs are refused by the op itself.
os.environ.setdefault("DSV4_CHECK_RANGES", "1")

MAX_WORKERS = 8  # each worker holds torch, tiny checkpoints and at times two ranks or a server


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup CPU quota (a container that
    sees every core of its host but may run on two)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = Path("/sys/fs/cgroup/cpu.max")
    if quota.exists() and (fields := quota.read_text().split())[0] != "max":
        cores = min(cores, math.ceil(int(fields[0]) / int(fields[1])))
    return max(1, cores)


def pytest_xdist_auto_num_workers(config) -> int:
    return min(usable_cores(), MAX_WORKERS)


# Under pytest-xdist the cores are shared by the workers: one OpenMP pool per worker sized to its share
# (through the environment, so the servers and ranks a test starts run on the same thread count).
if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores() // int(workers))))


def pytest_collection_modifyitems(config, items) -> None:
    """Hand the files marked `long` to the workers first: with one file per worker, a long file
    started last keeps one core busy alone while the others have finished (longest first is what
    keeps the cores even). The order within a file is kept."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
