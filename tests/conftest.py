import os
import tempfile

import pytest
import torch


def pytest_configure(config):
    """The suite's compiled kernels go to a cache of its own (never the user's ~/.cache); a cache
    directory given in the environment is kept (the device scripts time the cache on purpose)."""
    os.environ.setdefault("MOE_MXFP8_CACHE_DIR", tempfile.mkdtemp(prefix="moe_mxfp8-test-cache-"))


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip cleanly on machines without CUDA (CI); they run on the device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_device_capabilities():
    """Every test asks the GPU (or the one it stands in with monkeypatch) anew: the backend
    caches each GPU's compute capability for the process (`backend.device_capability`)."""
    from moe_mxfp8 import backend

    backend._capability_of_index.cache_clear()
    yield
    backend._capability_of_index.cache_clear()


@pytest.fixture
def gen():
    """A fresh, unseeded-per-run generator: every run draws new random data. Its seed is
    printed (pytest shows it with a failure's captured output; ``MOE_MXFP8_TEST_SEED=<seed>``
    replays that data)."""
    g = torch.Generator()
    replay = os.environ.get("MOE_MXFP8_TEST_SEED")
    if replay:
        g.manual_seed(int(replay))
    else:
        g.seed()
    print(f"gen seed {g.initial_seed()} (replay: MOE_MXFP8_TEST_SEED={g.initial_seed()})")
    return g
