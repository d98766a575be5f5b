import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def one_torch_thread():
    """The example's tests run many tiny ops; on a 2-core machine shared with other jobs, OpenMP's
    spinning wait makes them several times slower with 2 threads than with 1 (the commands set a
    passive wait before torch loads, which a test process cannot)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
