import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip cleanly on machines without CUDA (CI); they run on the device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gen():
    """A fresh, unseeded-per-run generator: every run draws new random data (the seed is printed
    on failure through the test id of `seed`)."""
    g = torch.Generator()
    g.seed()
    return g
