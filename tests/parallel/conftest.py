"""Every test here runs its ranks on one torch thread each: the CI has two cores, a CPU matmul's rounding
depends on the thread count (the workers copy rank 0's), and extra threads only contend."""

import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from engine.parallel.group import free_port
from model.testing.tiny import write_tiny


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def fp8_tiny(tmp_path_factory: pytest.TempPathFactory):
    """The tiny V4 with FP8 linears and MXFP4 routed experts."""
    return write_tiny(tmp_path_factory.mktemp("fp8"), fp8=True)


def kill_worker(llm) -> None:
    """SIGKILL ``llm``'s first worker process (rank 1) and wait for it to be gone."""
    worker = llm.workers.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=10)


def two_ranks(worker: Callable, here: Callable, arg: object) -> tuple[Any, Any]:
    """Rank 1 spawned (``worker(port, arg, results)`` puts its result on ``results``), rank 0 here
    (``here(0, port, arg)``): both results, the spawned process joined or terminated even on failure."""
    spawn = mp.get_context("spawn")
    results, port = spawn.Queue(), free_port()
    process = spawn.Process(target=worker, args=(port, arg, results), daemon=True)
    process.start()
    try:
        return here(0, port, arg), results.get(timeout=60)
    finally:
        process.join(timeout=10)
        if process.is_alive():
            process.terminate()
