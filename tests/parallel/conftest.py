"""Every test here runs its ranks on one torch thread each: the CI has two cores, a CPU matmul's rounding
depends on the thread count (the workers copy rank 0's), and extra threads only contend."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
