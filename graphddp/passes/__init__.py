"""Graph passes. Every pass has the signature ``(gm, schedule) -> gm`` and ends with
``gm.graph.lint(); gm.recompile()``; each module states its pre- and postconditions."""
from graphddp.passes.insert_allreduce import insert_allreduce

__all__ = ["insert_allreduce"]
