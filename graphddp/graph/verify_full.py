"""Where the compiler finds full sharding's checks: :mod:`graphddp.graph.verify` (P1-P6)."""
from graphddp.graph.verify import check_part_collectives, check_part_updates

__all__ = ["check_part_collectives", "check_part_updates"]
