"""The check both sharded-memory workers make: a strategy's memory_report vs the formula."""

__all__ = ["check_report"]


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
