"""The mutations of the verifier's mutation tests (``test_verify_mutations.py``): each corrupts
one rewritten graph of ``mutation_cases`` and returns the name of the node the verifier must
point at. ``MUTATIONS`` names each, with the cases it applies to and (in a comment) the verifier
invariant that catches it.
"""
from __future__ import annotations

from typing import Callable

import test_passes
import torch
import torch.fx as fx
from mutation_cases import ALL, CARRYING, COMPRESSED, DIVIDED, EARLY, GATED, PLAIN, WORLD, Case, add_node

from graphddp.values.comm import ALL_REDUCE, BUCKET_KEY, CAST, WAIT

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# mutations: each corrupts ``case`` and returns the name of the node the verifier must point at


def wrong_divisor(c: Case) -> str:
    scale = c.one(c.biggest().index, "scale")
    scale.args = (scale.args[0], WORLD + 1)
    return scale.name


def unscaled(c: Case) -> str:
    b = c.biggest().index
    scale, ar = c.one(b, "scale"), c.one(b, "all_reduce")
    ar.args = (scale.args[0], *ar.args[1:])
    c.gm.graph.erase_node(scale)
    return ar.name


def scaled_twice(c: Case) -> str:
    scale = c.one(c.biggest().index, "scale")
    extra = add_node(c, scale, aten.div.Tensor, (scale.args[0], WORLD), like=scale, before=True)
    scale.args = (extra, WORLD)
    return extra.name


def divided_before_its_gate(c: Case) -> str:
    """A gated bucket divided in the graph too: its gate divides again."""
    ar = c.one(c.biggest().index, "all_reduce")
    extra = add_node(c, ar, aten.div.Tensor, (ar.args[0], WORLD), like=ar.args[0], before=True)
    ar.args = (extra, *ar.args[1:])
    return extra.name


def wrong_group(c: Case) -> str:
    ar = c.one(0, "all_reduce")
    ar.args = (ar.args[0], "sum", "not-" + c.schedule.group_name)
    return ar.name


def wrong_reduce_op(c: Case) -> str:
    ar = c.one(c.biggest().index, "all_reduce")
    ar.args = (ar.args[0], "avg", ar.args[2])
    return ar.name


def issued_before_producer(c: Case) -> str:
    b = c.biggest()
    ar = c.one(b.index, "all_reduce")
    c.node(b.slots[-1].producer).prepend(ar)
    return ar.name


def issued_before_producer_per_schedule(c: Case) -> str:
    """Schedule and graph agree on an issue point that comes before the bucket's last gradient."""
    b = c.biggest()
    ar = c.one(b.index, "all_reduce")
    c.node(b.slots[-1].producer).prepend(ar)
    c.schedule = test_passes.with_buckets(c.schedule, **{f"b{b.index}": dict(issue_after=ar.prev.name)})
    return ar.name


def issued_before_issue_after(c: Case) -> str:
    """The schedule asks for a later issue point than the graph has (rewrite ignored it)."""
    b = c.schedule.buckets[0]
    assert b.overlap, "the first bucket has compute after it"
    c.schedule = test_passes.with_buckets(c.schedule, b0=dict(issue_after=b.overlap[-1]))
    return c.one(0, "all_reduce").name


def wait_after_output(c: Case) -> str:
    wait = c.one(c.biggest().index, "wait")
    c.gm.graph.output_node().append(wait)
    return wait.name


def wait_after_wait_before(c: Case) -> str:
    """Lint-clean: the wait and its unflatten views all move to just after wait_before."""
    wait = c.one(0, "wait")
    anchor = c.node(c.schedule.buckets[0].wait_before)
    moved = [wait] + c.ours(0, "decompress") + c.ours(0, "unflatten")
    for node in reversed(moved):
        anchor.append(node)
    return wait.name


def early_reader(c: Case) -> str:
    """Compute reads a reduced gradient before the schedule's wait_before."""
    view = c.ours(0, "unflatten")[-1]
    anchor = view.next
    reader = add_node(c, anchor, aten.neg.default, (view,), like=view, before=True)
    return reader.name


def buffer_read_in_flight(c: Case) -> str:
    ar = c.one(c.biggest().index, "all_reduce")
    sent = ar.args[0]  # the scaled buffer (a gated bucket's: the flat one)
    reader = add_node(c, ar, aten.add.Tensor, (sent, 1), like=sent)
    return reader.name


def missing_compress(c: Case) -> str:
    b = c.biggest().index
    cast, scale, ar = c.one(b, "compress"), c.one(b, "scale"), c.one(b, "all_reduce")
    scale.args = (cast.args[0], *scale.args[1:])
    c.gm.graph.erase_node(cast)
    return ar.name


def wrong_compress_dtype(c: Case) -> str:
    cast = c.one(c.biggest().index, "compress")
    other = torch.bfloat16 if cast.args[1] == torch.float16 else torch.float16
    cast.args = (cast.args[0], other)
    return cast.name


def extra_compress(c: Case) -> str:
    b = c.biggest().index
    first = (c.ours(b, "scale") or c.ours(b, "all_reduce"))[0]  # what reads the flat buffer (a gated bucket: its all-reduce)
    cast = add_node(c, first, CAST, (first.args[0], torch.bfloat16), like=first.args[0],
                    tag=(b, "compress"), before=True)
    first.args = (cast, *first.args[1:])
    return cast.name


def compressed_twice(c: Case) -> str:
    b = c.biggest()
    cast = c.one(b.index, "compress")
    again = add_node(c, cast, CAST, (cast.args[0], getattr(torch, b.comm_dtype)), like=cast,
                     tag=(b.index, "compress"), before=True)
    cast.args = (again,)
    return again.name


def wrong_decompress_dtype(c: Case) -> str:
    cast = c.one(c.biggest().index, "decompress")
    cast.args = (cast.args[0], torch.float64)
    return cast.name


def drop_node(c: Case, node: fx.Node, keep: fx.Node) -> str:
    """Erase ``node``, its users reading ``keep`` (its input) instead; names ``keep``."""
    node.replace_all_uses_with(keep)
    c.gm.graph.erase_node(node)
    return keep.name


def missing_decompress(c: Case) -> str:
    b = c.biggest().index
    return drop_node(c, c.one(b, "decompress"), keep=c.one(b, "wait"))


def extra_decompress(c: Case) -> str:
    b = c.biggest()
    wait = c.one(b.index, "wait")
    cast = add_node(c, wait, CAST, (wait, getattr(torch, b.dtype)), like=wait,
                    tag=(b.index, "decompress"))
    wait.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
    return cast.name


def unreduced_output(c: Case) -> str:
    slot = c.biggest().slots[1]
    outs = c.outs()
    outs[slot.output_index] = c.node(slot.producer)
    c.set_outs(outs)
    return slot.producer


def output_from_flat_piece(c: Case) -> str:
    """A gradient returned as graphddp's flattening view of itself, from before the all-reduce."""
    b = c.biggest()
    slot = b.slots[0]
    piece = list(c.ours(b.index, "flatten")[-1].args[0])[0]
    view = add_node(c, piece, aten.view.default, (piece, list(slot.shape)), like=c.node(slot.producer), tag=(b.index, "unflatten"))
    outs = c.outs()
    outs[slot.output_index] = view
    c.set_outs(outs)
    return view.name


def wrong_slice(c: Case) -> str:
    """Two gradients of one bucket swap slices: the lower output gets the other's slice."""
    first, second = sorted(c.biggest().slots[:2], key=lambda s: s.output_index)
    outs = c.outs()
    outs[first.output_index], outs[second.output_index] = outs[second.output_index], outs[first.output_index]
    c.set_outs(outs)
    return outs[first.output_index].args[0].name


def wrong_bucket(c: Case) -> str:
    a, b = c.schedule.buckets[0].slots[0], c.schedule.buckets[1].slots[0]
    first, second = sorted((a, b), key=lambda s: s.output_index)
    outs = c.outs()
    outs[first.output_index], outs[second.output_index] = outs[second.output_index], outs[first.output_index]
    c.set_outs(outs)
    other = b if first is a else a
    return c.one([bk.index for bk in c.schedule.buckets if other in bk.slots][0], "wait").name


def unflattened_to_wrong_shape(c: Case) -> str:
    slot = c.biggest().slots[0]
    view = c.outs()[slot.output_index]
    view.args = (view.args[0], list(slot.shape) + [1])
    return view.name


def reduced_twice(c: Case) -> str:
    b = c.biggest().index
    ar, wait = c.one(b, "all_reduce"), c.one(b, "wait")
    again = add_node(c, ar, ALL_REDUCE, ar.args, like=ar, tag=(b, "all_reduce"))
    add_node(c, wait, WAIT, (again,), like=wait, tag=(b, "wait"))
    return again.name


def no_wait(c: Case) -> str:
    b = c.biggest().index
    return drop_node(c, c.one(b, "wait"), keep=c.one(b, "all_reduce"))


def two_waits(c: Case) -> str:
    b = c.biggest().index
    ar, wait = c.one(b, "all_reduce"), c.one(b, "wait")
    add_node(c, wait, WAIT, (ar,), like=wait, tag=(b, "wait"))
    return ar.name


def stray_wait(c: Case) -> str:
    """A graphddp wait on something that is not its bucket's all-reduce (here, a gradient)."""
    b = c.biggest()
    ar, producer = c.one(b.index, "all_reduce"), c.node(b.slots[0].producer)
    stray = add_node(c, ar, WAIT, (producer,), like=producer, tag=(b.index, "wait"))
    return stray.name


def wait_untagged(c: Case) -> str:
    """A pass rebuilt the wait without graphddp's tag: it no longer belongs to its bucket."""
    wait = c.one(c.biggest().index, "wait")
    del wait.meta[BUCKET_KEY]
    return wait.name


def out_of_place_all_reduce(c: Case) -> str:
    ar = c.one(c.biggest().index, "all_reduce")
    ar.target = torch.ops._c10d_functional.all_reduce.default
    return ar.name


def all_reduce_of_unknown_bucket(c: Case) -> str:
    ar = c.one(c.biggest().index, "all_reduce")
    ar.meta[BUCKET_KEY] = c.schedule.num_buckets
    return ar.name


def cat_missing_slot(c: Case) -> str:
    cat = c.ours(c.biggest().index, "flatten")[-1]
    assert cat.target == aten.cat.default
    cat.args = (list(cat.args[0])[:-1],)
    return cat.name


def cat_slots_swapped(c: Case) -> str:
    cat = c.ours(c.biggest().index, "flatten")[-1]
    pieces = list(cat.args[0])
    pieces[0], pieces[1] = pieces[1], pieces[0]
    cat.args = (pieces,)
    return pieces[0].name


def cat_piece_wrong_size(c: Case) -> str:
    piece = list(c.ours(c.biggest().index, "flatten")[-1].args[0])[1]
    piece.args = (piece.args[0], [piece.args[1][0] + 1])
    return piece.name


def cat_piece_not_a_view(c: Case) -> str:
    """The cat takes zeros the size of a gradient instead of a flattening view of it."""
    b = c.biggest()
    cat = c.ours(b.index, "flatten")[-1]
    pieces = list(cat.args[0])
    piece = pieces[0]
    zeros = add_node(c, piece, aten.new_zeros.default, (c.node(b.slots[0].producer), [b.slots[0].numel]), like=piece)
    pieces[0] = zeros
    cat.args = (pieces,)
    return zeros.name


def foreign_op_in_buffer(c: Case) -> str:
    """Something graphddp does not emit sits between the cat and the all-reduce."""
    cat = c.ours(c.biggest().index, "flatten")[-1]
    (user,) = cat.users
    extra = add_node(c, cat, aten.clone.default, (cat,), like=cat)
    user.replace_input_with(cat, extra)
    return extra.name


def cat_of_wrong_gradient(c: Case) -> str:
    """A piece flattens another bucket's gradient (its producer), not its own."""
    big = c.biggest()
    other = next(b for b in c.schedule.buckets if b is not big and b.dtype == big.dtype)
    piece = list(c.ours(big.index, "flatten")[-1].args[0])[0]
    piece.args = (c.node(other.slots[0].producer), [big.slots[0].numel])
    return piece.name


def unsliced_view(c: Case) -> str:
    """A gradient viewed straight from its bucket's (reduced) buffer, without its slice."""
    b = c.biggest()
    slot = b.slots[-1]
    view = c.outs()[slot.output_index]
    piece = view.args[0]
    unsliced = add_node(c, view, aten.view.default, (piece.args[0], [-1]), like=piece.args[0], tag=(b.index, "unflatten"))
    outs = c.outs()
    outs[slot.output_index] = unsliced
    c.set_outs(outs)
    return unsliced.name


def compute_out_of_order(c: Case) -> str:
    """Not about communication at all: a model node moved after its own user."""
    producers = {s.producer for b in c.schedule.buckets for s in b.slots} | {b.issue_after for b in c.schedule.buckets}
    for node in c.gm.graph.nodes:
        users = [u for u in node.users if u.op == "call_function" and BUCKET_KEY not in u.meta]
        if node.op == "call_function" and BUCKET_KEY not in node.meta and node.name not in producers and users:
            users[0].append(node)
            return users[0].name
    raise AssertionError("no model node with a model user")


def untouched_output_rerouted(c: Case) -> str:
    """An output that needs no synchronisation is returned from a bucket."""
    planned = {s.output_index for b in c.schedule.buckets for s in b.slots}
    index = next(i for i in range(len(c.outs())) if i not in planned)
    outs = c.outs()
    view = c.ours(0, "unflatten")[-1]
    outs[index] = view
    c.set_outs(outs)
    return view.name


def missing_fake_value(c: Case) -> str:
    node = c.one(c.biggest().index, "scale")
    del node.meta["val"]
    return node.name


def carried_into_the_wrong_slot(c: Case) -> str:
    """Two slots of a bucket add each other's accumulated gradient."""
    first, second = c.ours(c.biggest().index, "carry")[:2]
    a, b = first.args[1], second.args[1]
    first.args, second.args = (first.args[0], b), (second.args[0], a)
    (piece,) = first.users
    return piece.name


def carry_left_out(c: Case) -> str:
    """A slot's piece flattens its new gradient alone: its accumulated one is never averaged."""
    add = c.ours(c.biggest().index, "carry")[0]
    carried = add.args[1]
    add.replace_all_uses_with(add.args[0])
    c.gm.graph.erase_node(add)
    return carried.name


# name -> (mutation, the cases it applies to); the comment is the verifier invariant that catches it
MUTATIONS: dict[str, tuple[Callable[[Case], str], tuple[str, ...]]] = {
    "wrong-divisor": (wrong_divisor, DIVIDED),  # invariant 5
    "unscaled": (unscaled, DIVIDED),  # invariant 5
    "scaled-twice": (scaled_twice, DIVIDED),  # invariant 5
    "wrong-group": (wrong_group, ALL),  # invariant 3
    "wrong-reduce-op": (wrong_reduce_op, ALL),  # invariant 3
    "issued-before-producer": (issued_before_producer, ALL),  # invariant 4
    "issued-before-producer-per-schedule": (issued_before_producer_per_schedule, ALL),  # invariant 11
    "issued-before-issue-after": (issued_before_issue_after, ALL),  # invariant 4
    "wait-after-output": (wait_after_output, ALL),  # invariant 9
    "wait-after-wait-before": (wait_after_wait_before, EARLY),  # invariant 9
    "early-reader": (early_reader, ALL),  # invariant 9
    "buffer-read-in-flight": (buffer_read_in_flight, ALL),  # invariant 8
    "missing-compress-cast": (missing_compress, COMPRESSED),  # invariant 6
    "wrong-compress-dtype": (wrong_compress_dtype, COMPRESSED),  # invariant 6
    "extra-compress-cast": (extra_compress, PLAIN),  # invariant 6
    "compressed-twice": (compressed_twice, COMPRESSED),  # invariant 6
    "missing-decompress-cast": (missing_decompress, COMPRESSED),  # invariant 6
    "wrong-decompress-dtype": (wrong_decompress_dtype, COMPRESSED),  # invariant 6
    "extra-decompress-cast": (extra_decompress, PLAIN),  # invariant 6
    "unreduced-output": (unreduced_output, ALL),  # invariant 10
    "output-from-flat-piece": (output_from_flat_piece, ALL),  # invariant 10
    "wrong-slice": (wrong_slice, ALL),  # invariant 10
    "wrong-bucket": (wrong_bucket, ALL),  # invariant 10
    "wrong-unflatten-shape": (unflattened_to_wrong_shape, ALL),  # invariant 10
    "unsliced-view": (unsliced_view, ALL),  # invariant 10
    "reduced-twice": (reduced_twice, ALL),  # invariant 1
    "no-wait": (no_wait, ALL),  # invariant 1
    "two-waits": (two_waits, ALL),  # invariant 1
    "stray-wait": (stray_wait, ALL),  # invariant 1
    "wait-untagged": (wait_untagged, ALL),  # invariant 1
    "out-of-place-all-reduce": (out_of_place_all_reduce, ALL),  # invariant 1
    "all-reduce-of-unknown-bucket": (all_reduce_of_unknown_bucket, ALL),  # invariant 1
    "cat-missing-slot": (cat_missing_slot, ALL),  # invariant 7
    "cat-slots-swapped": (cat_slots_swapped, ALL),  # invariant 7
    "cat-of-wrong-gradient": (cat_of_wrong_gradient, ALL),  # invariant 7
    "cat-piece-wrong-size": (cat_piece_wrong_size, ALL),  # invariant 7
    "cat-piece-not-a-view": (cat_piece_not_a_view, ALL),  # invariant 7
    "foreign-op-in-buffer": (foreign_op_in_buffer, ALL),  # invariant 7
    "untouched-output-rerouted": (untouched_output_rerouted, ALL),  # invariant 10
    "missing-fake-value": (missing_fake_value, DIVIDED),  # invariant 2
    "divided-before-its-gate": (divided_before_its_gate, GATED),  # invariant 5
    "compute-out-of-order": (compute_out_of_order, ALL),  # invariant 11
    "carried-into-the-wrong-slot": (carried_into_the_wrong_slot, CARRYING),  # invariant 7
    "carry-left-out": (carry_left_out, CARRYING),  # invariant 7
}
