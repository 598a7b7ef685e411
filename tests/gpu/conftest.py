"""The GPU lane (``make test-gpu``): skipped, each test, where CUDA is absent, so the CPU suite
collects it and CI passes without a GPU."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        lanes = [item.module for item in items if item.module.__name__ == "test_gpu_lane"]
        if lanes:  # its cases compile on the host's cores while the tests before them run
            lanes[0].start_in_background()
        return
    skip = pytest.mark.skip(reason="the GPU lane needs CUDA (make test-gpu on a machine with a GPU)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture
def nccl_world_of_one():
    """NCCL at world size 1 on GPU 0 (two NCCL ranks cannot share one GPU), torn down after."""
    import os
    import tempfile

    import torch.distributed as dist

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    dist.destroy_process_group()
