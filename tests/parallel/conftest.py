"""Every test here runs its ranks on one torch thread each: the CI has two cores, a CPU matmul's rounding
depends on the thread count (the workers copy rank 0's), and extra threads only contend."""

import os
import signal
from collections.abc import Iterator

import pytest
import torch

from model.tiny import write_tiny


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
