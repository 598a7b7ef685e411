"""Where the compiler finds ``sharding="optimizer"``'s checks: :mod:`graphddp.optim.verify` (S1-S7)."""
from graphddp.optim.verify import verify_sharded

__all__ = ["verify_sharded"]
