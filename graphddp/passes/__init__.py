"""Graph passes. Every pass has the signature ``(gm, schedule[, what it needs]) -> gm`` and ends with
``gm.graph.lint(); gm.recompile()``; each module states its pre- and postconditions."""
from graphddp.passes.insert_allreduce import insert_allreduce
from graphddp.passes.insert_update import insert_update

__all__ = ["insert_allreduce", "insert_update"]
