"""Communication hooks: the built-in ones (allreduce, fp16/bf16 compression), users' traced hooks
and PowerSGD. ``graphddp.hooks.PowerSGD`` and ``graphddp.hooks.GradBucket`` are the public names."""
from graphddp.hooks.builtin import ALLREDUCE, BUILTIN, CommHook, cast_hook, for_bucket
from graphddp.hooks.powersgd import PowerSGD
from graphddp.hooks.traced import HOOK_STATE_KEY, GradBucket, TracedHook

__all__ = ["ALLREDUCE", "BUILTIN", "HOOK_STATE_KEY", "CommHook", "GradBucket", "PowerSGD", "TracedHook", "cast_hook", "for_bucket"]
