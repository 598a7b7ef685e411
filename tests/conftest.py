"""Shared test settings: one inductor cache for all tests (and spawned ranks), one thread, and
long-lived groups of gloo ranks (2, 3 and 4) that multi-rank tests run on (``graphddp.testing.reuse_ranks``)."""
import os
import tempfile

import pytest
import torch

os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "graphddp-test-inductor-cache")
)
torch.set_num_threads(1)
# Inductor's GPU-only compile paths (comprehensive padding) on CPU graphs, here and in every
# spawned rank: a rewrite that leaves the graph's bookkeeping stale fails here, not on a GPU.
os.environ.setdefault("GRAPHDDP_TEST_INDUCTOR_GPU_PATHS", "1")
if os.environ["GRAPHDDP_TEST_INDUCTOR_GPU_PATHS"] == "1":
    from graphddp.testing import force_inductor_gpu_paths

    force_inductor_gpu_paths()


@pytest.fixture(scope="session", autouse=True)
def _rank_pool():
    from graphddp.testing import reuse_ranks

    reuse_ranks(os.environ.get("GRAPHDDP_TEST_FRESH_RANKS") != "1")
    yield
    reuse_ranks(False)


@pytest.fixture(autouse=True)
def _frozen_survivors():
    """Before each test, what earlier tests left alive is frozen out of the collector's walks
    (``graphddp.testing.freeze_survivors``): collections during compiles stay cheap."""
    from graphddp.testing import freeze_survivors

    freeze_survivors()
    yield


@pytest.fixture(autouse=True)
def _own_recompile_limit():
    """On a torch where every compile of the same code shares one recompile limit (no
    ``isolate_recompiles``), each test starts from a Dynamo reset: else the suite's compiles of
    the same model classes reach the limit and later tests' models run eagerly."""
    from graphddp.testing import missing_torch_feature

    if missing_torch_feature("isolated_recompiles"):
        torch._dynamo.reset()
    yield


@pytest.fixture
def fake_world():
    """A fake process group of 8 ranks in this process, torn down after the test."""
    from graphddp.testing import init_fake_process_group, release_process_group

    def make(world_size: int = 8) -> None:
        init_fake_process_group(world_size)

    yield make
    release_process_group()
