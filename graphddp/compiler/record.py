"""What graphddp did to one compiled graph, in every mode: :class:`GraphRecord`, below both the
backends and the compile cache that make records, so that none imports another for it.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Sequence

import torch.fx as fx

from graphddp.graph.insert_comm import HOOK_STATE
from graphddp.optim.insert_update import UPDATE_INPUT
from graphddp.values.comm import CARRIED, ROLE_KEY
from graphddp.values.part_schedule import PartGraph
from graphddp.values.schedule import Schedule


# The records' key of a graph's carrying variant: each bucket also takes the gradients
# accumulated under no_sync.
CARRY = "carry"
# Full sharding's key of a backward's variant that updates its parts inside.
UPDATING = "backward_update"


@dataclasses.dataclass
class GraphRecord:
    """What graphddp did to one compiled graph, one type for every mode so that ``model.records``
    and ``model.graphs`` read the same in each: the plan (a replicated or sharded backward's
    :class:`Schedule`, full sharding's :class:`PartGraph`; None for a forward it does not plan),
    the graph, inductor's code where inductor compiled it, and the variants compiled beside it."""

    schedule: Schedule | PartGraph | None
    graph: fx.GraphModule
    generated_code: str | None = None
    kind: str = "backward"  # "forward", "backward", or a variant's key (CARRY, UPDATING)
    index: int = 0  # the Dynamo graph it came from
    # With an optimizer: the graph before insert_update (all-reduces only), for the steps
    # the graph cannot update alone.
    without_update: fx.GraphModule | None = None

    # A user hook with phases (PowerSGD): every phase's record, this one included.
    phases: dict[str, "GraphRecord"] = dataclasses.field(default_factory=dict)
    # With an optimizer: parameters whose update torch's step took over after the backward, by
    # reason (StepState.not_inside), as of the last step it happened.
    fallbacks: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # Variants compiled beside the graph, by kind (CARRY, UPDATING).
    variants: dict[str, "GraphRecord"] = dataclasses.field(default_factory=dict)

    def fell_back(self, kind: str, names: Sequence[str], why: str, warned: set[tuple[int, str]]) -> None:
        """Torch's step after the backward updates ``names``, for the reason ``kind``
        (``StepState.not_inside``): recorded in :attr:`fallbacks` and, where there is a ``why``,
        warned once per graph and kind (``warned``: the mode's set of those warned): right, but not overlapped."""
        self.fallbacks[kind] = tuple(names)
        if not why or (self.index, kind) in warned:
            return
        warned.add((self.index, kind))
        warnings.warn(
            f"graphddp: optimizer= : backward graph {self.index} leaves the update of {list(names)} to torch's step "
            f"after the backward ({why}); the result is the same, the update is not overlapped with the backward. "
            "GraphRecord.fallbacks shows it.",
            stacklevel=3,
        )

    @property
    def carrying(self) -> "GraphRecord | None":
        """The carrying variant's record, where the graph has one."""
        return self.variants.get(CARRY)

    @staticmethod
    def _inputs(graph: fx.GraphModule, *roles: str) -> list[Any]:
        return [n.meta["val"] for n in graph.graph.nodes if n.op == "placeholder" and n.meta.get(ROLE_KEY) in roles]

    def extra_inputs(self) -> list[Any]:
        """Fake values of the inputs graphddp appended, in input order: carried gradients or a
        hook's state, then the update's."""
        return self._inputs(self.graph, CARRIED, HOOK_STATE, UPDATE_INPUT)

    def hook_inputs(self) -> list[Any]:
        """Fake values of the inputs the graph without update reads beyond AOTAutograd's: a
        user hook's state, or the carried gradients."""
        graph = self.without_update if self.without_update is not None else self.graph
        return self._inputs(graph, CARRIED, HOOK_STATE)


def graphs_of(records: list[GraphRecord]) -> list[tuple[str, fx.GraphModule]]:
    """Every compiled graph of ``records``, in order, each followed by its variants: ``model.graphs``."""
    return [(r.kind, r.graph) for record in records for r in (record, *record.variants.values())]
