"""The GPU lane (``make test-gpu``): skipped, each test, where CUDA is absent, so the CPU suite
collects it and CI passes without a GPU."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="the GPU lane needs CUDA (make test-gpu on a machine with a GPU)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
