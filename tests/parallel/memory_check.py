"""The checks both sharded-memory workers make: a strategy's memory_report vs the formula,
its transient buffers vs the budgets its options set, and its parameters vs one process."""

import torch

__all__ = ["check_report", "check_buffers", "check_matches", "BUCKETS", "PEAK_TARGET"]

# reduce_bucket_size / allgather_bucket_size cases: the defaults (None), a bucket that splits
# every unit of the tiny gpt into many pieces (and is smaller than any unit: no prefetch),
# and one larger than the whole model.
BUCKETS = (None, 4096, 1 << 40)
PEAK_TARGET = 1.05  # measured peak / (formula + buffers), as `bench memory` holds RSS to


def check_report(label, rep, psi, units, want):
    """Assert params/grads/optimizer bytes of `rep` are within 10% of `want` plus padding.

    want = (params, grads, optimizer) bytes from the ZeRO formula; padding is the flat
    buffers' extra elements, and AdamW's scalar step count per shard is allowed for.
    """
    assert rep["trainable_numel"] == psi, (rep, psi)
    pad = 4 * (rep["padded_numel"] - psi)
    steps = 4 * units  # AdamW's scalar step count per shard
    for key, w, slack in zip(("params", "grads", "optimizer"), want, (pad, pad, 2 * pad + steps)):
        got = rep[key]
        assert abs(got - w) <= 0.1 * w + slack, (
            f"{label}: {key} = {got} bytes, formula {w:.0f} (+-10% + padding {slack}); "
            f"report {rep}")


def check_buffers(label, rep, want, units, bucket, allgather, overlapped, prefetch,
                  keep_gathered=False, accum=1):
    """The transient buffers, measured by the engine, against the budgets of the options.

    want: the formula's (params, grads, optimizer) bytes; units: the FlatUnits; bucket /
    allgather: the reduce_bucket_size / allgather_bucket_size in use; overlapped: the
    strategy reduces during backward (not zero1, which reduces at the step); prefetch:
    backward prefetch is on; keep_gathered: every unit stays gathered from forward to
    backward (SHARD_GRAD_OP: all of them count as gathered); accum: micro-batches per step
    (above 1 every unit's full gradients live until the last one's reductions). The
    reduction's piece buffers never exceed the bucket (one piece of one
    element per rank always gets through), nothing is gathered ahead beyond the allgather
    bucket, and the rank's peak, counted high as the sum of each part's measured peak
    (states + units gathered at once + reduction buffers), stays within PEAK_TARGET of
    formula + buffers: the formula's states, the units gathered at once (the root unit,
    which stays gathered through forward and backward, and the largest other one), the
    prefetch budget, the reduction's limit and, where gradients are reduced during backward,
    the full gradients of the unit whose backward runs (and the root unit's, which wait for
    its embedding's at the end of backward). Returns measured / budget."""
    n = rep["shard_group"]
    if n > 1:  # zero1: the step's whole-unit reduce-scatter, within its own limit
        assert 0 < rep["reduce_buffers"] <= rep["reduce_buffers_limit"], (label, rep)
    else:
        assert rep["reduce_buffers_limit"] == 0, (label, rep)
    if overlapped and n > 1:
        assert 0 < rep["transient_grad_bucket"] <= max(bucket, 8 * n), (label, rep)
        assert rep["reduce_bucket_size"] == bucket, (label, rep)
    ahead = allgather if prefetch else 0
    assert rep["peak_prefetched"] <= ahead and rep["prefetch_buffer"] <= ahead, (label, rep)
    roots = [u for u in units if u.name == "<root>"]  # the model's own parameters
    others = [u for u in units if u.name != "<root>"] or roots
    blocks = [u.full_bytes() for u in others]
    root_grads = sum(4 * u.numel for u in roots if u not in others)  # fp32 full gradients
    block_grads = [4 * u.numel for u in others]
    if prefetch and n > 1 and allgather >= max(blocks):
        assert rep["peak_prefetched"] > 0, (label, rep)  # it did gather ahead
    if prefetch and allgather < min(blocks):
        assert rep["peak_prefetched"] == 0, (label, rep)  # no unit fits: none ahead
    gathered = (sum(u.full_bytes() for u in roots if u not in others) + max(blocks)) \
        if rep["largest_gathered_unit"] else 0
    if keep_gathered:
        gathered = sum(u.full_bytes() for u in units)
    grads = 0
    if overlapped:  # a unit's full gradients until its reduction: the root's wait for it
        grads = root_grads + max(block_grads) if accum == 1 else 4 * sum(u.numel for u in units)
        assert rep["unit_grads_limit"] == grads, (label, rep)
        assert 0 < rep["unit_grads"] <= grads, (label, rep)
    measured = (rep["params"] + rep["grads"] + rep["optimizer"] + rep["peak_gathered"] +
                rep["reduce_buffers"] + rep["unit_grads"])
    budget = (sum(want) + gathered + rep["prefetch_buffer"] + rep["reduce_buffers_limit"] +
              grads)
    slack = 4 * 4 * (rep["padded_numel"] - rep["trainable_numel"]) + 4 * len(units)
    assert measured <= PEAK_TARGET * budget + slack, (
        f"{label}: measured {measured} bytes > {PEAK_TARGET} x (formula + buffers) "
        f"{budget} (+ padding {slack}); report {rep}")
    return measured / budget


def check_matches(label, got: dict, want: dict):
    """Every tensor of the gathered state matches one process's to rtol 1e-5."""
    assert sorted(got) == sorted(want), (label, sorted(got), sorted(want))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=k: f"{label}: {k}: {m}")
