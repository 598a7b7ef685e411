"""DistributedDataParallel's constructor keywords on ``graphddp.compile``.

Users swap ``DDP(model, **kw)`` for ``graphddp.compile(model, **kw)``: each keyword is accepted
with DDP's meaning where graphddp does what it asks, else refused by name, never silently
ignored (docs/ddp-features.md lists them). None of them shapes the plan.
"""
from __future__ import annotations

from typing import Any

import torch


def constructor_keywords() -> set[str]:
    """Every keyword of DistributedDataParallel's constructor (to say so when one is refused)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    return set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module"}


def check_device_spec(name: str, value: Any) -> None:
    """A device as DDP takes one: an accelerator index, a string or a ``torch.device``."""
    if isinstance(value, bool) or not isinstance(value, (int, str, torch.device)) or (isinstance(value, int) and value < 0):
        raise ValueError(f"{name} must name a device (an index, a string or a torch.device), got {value!r}")
    if isinstance(value, str):
        try:
            torch.device(value)
        except RuntimeError as e:
            raise ValueError(f"{name}: {value!r} is not a device: {e}") from None


def names_device(value: Any, device: torch.device) -> bool:
    """Does DDP's ``value`` (an index of the accelerator, a string, a device) name ``device``?
    An index without a type, and a type without an index, resolve as DDP resolves them
    (``torch._utils._get_device_index``: the current device of that type)."""
    from torch._utils import _get_device_index

    if isinstance(value, int):
        return device.type != "cpu" and value == device.index
    named = torch.device(value)
    if named.type != device.type:
        return False
    return device.type == "cpu" or (named.index if named.index is not None else _get_device_index(named, True)) == device.index


def check_keywords(config: Any) -> tuple[Any, ...] | None:
    """Refuse what graphddp does not do; ``device_ids`` as a tuple (empty: not given, as in DDP)."""
    ids = config.device_ids
    if ids is not None:
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"device_ids must be None or a list of one device, as DDP takes it, got {ids!r}")
        if len(ids) > 1:
            raise ValueError(
                f"device_ids can only be None or contain a single element (as in DDP), got {list(ids)!r}: "
                "graphddp runs one device per process"
            )
        for i, value in enumerate(ids):
            check_device_spec(f"device_ids[{i}]", value)
    if config.output_device is not None:
        check_device_spec("output_device", config.output_device)
    for name in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view"):
        value = getattr(config, name)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    if config.gradient_as_bucket_view is False:
        raise ValueError(
            "gradient_as_bucket_view=False asks for gradients copied out of their bucket; graphddp's compiled "
            "backward returns each gradient as a view of its bucket's averaged buffer (DDP's "
            "gradient_as_bucket_view=True) and makes no copy: pass True or leave the keyword out"
        )
    return (tuple(ids) or None) if ids is not None else None


def check_devices(where: str, device_ids: tuple[Any, ...] | None, output_device: Any, device: torch.device | None) -> None:
    """``device_ids`` and ``output_device`` may name only the device of the module's parameters
    (``device``): graphddp runs the model there and leaves its outputs there, DDP's meaning for a
    single-device module."""
    named = [("device_ids", device_ids[0])] if device_ids else []
    named += [("output_device", output_device)] if output_device is not None else []
    for name, value in named:
        if device is None or not names_device(value, device):
            given = list(device_ids) if name == "device_ids" else output_device
            raise ValueError(
                f"{where}: {name}={given!r} does not name the device of the module's parameters ({device}): "
                f"graphddp runs the model where its parameters are and leaves its outputs there; move the model "
                f"first (model.to(...)) or leave {name} out"
            )
