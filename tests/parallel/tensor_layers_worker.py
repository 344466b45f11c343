"""Under mpirun: tensor parallel (and sequence parallel) vs one process, many cases per launch.

On every tp group of this world size (tp = world size; at 4 ranks also tp=2 x dp=2), float64:

1. adjoints: every communicating Function of parallel/tensor/ops.py is the exact adjoint of
   its forward (tests/adjoint.py), alone where its spaces allow it, composed otherwise;
2. layers split by ``prepare`` (column/row-parallel linears, a fused qkv, an MLP, the
   vocabulary-parallel embedding, the sequence-split position embedding, the vocab head
   with its loss, the vocabulary-parallel cross-entropy itself, a whole tiny GPT; Hugging
   Face Conv1D column/row/fused qkv; a vocabulary of 23 padded to a multiple of tp, the
   embedding with a padding_idx): forward and every gradient equal the unsplit module's,
   sequence parallel off and on;
3. the collectives of one transformer block, forward and backward, logged by a recording
   communicator: exactly Megatron's 2 + 2 all-reduces (no SP) or 2 + 2 all-gathers and 2 + 2
   reduce-scatters (SP) of b*s*h elements each, the same bytes on the wire, nothing else
   (and the loss: two all-reduces per token forward, none backward);
4. memory: a split GPT's local parameter bytes are the cut parameters / tp plus the
   replicated ones, exactly; sequence parallel divides the activations saved for backward
   in the LayerNorm and dropout regions by tp;
5. dropout: a GPT with dropout 0.1 in training gives one process's logits, loss and
   gradients for the same seed (the same masks), sequence parallel off and on.

Rank 0 prints one summary line per section; tests/parallel/test_tensor_layers.py reads them.
"""

import copy
import fnmatch
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.models.gpt import GPT, GPTBlock, lm_loss, tp_plan
from hpctrain.parallel.placement import placement_of
from hpctrain.parallel.sharding.engine import nbytes
from hpctrain.parallel.tensor import TensorOptions, prepare
from hpctrain.parallel.tensor.loss import vocab_parallel_cross_entropy
from hpctrain.parallel.tensor.ops import (copy_to, gather_seq, reduce_from, reduce_scatter_seq,
                                          split_seq)
from hpctrain.runtime.mesh import MeshLayout
from hpctrain.runtime.world import init_world
from tests.adjoint import check_adjoint

TOL = dict(rtol=1e-12, atol=1e-12)
DT = torch.float64
B, S, H = 2, 8, 16          # batch, sequence (divisible by tp = 2, 4), hidden
GPT_KW = dict(vocab=68, d_model=16, heads=4, layers=2, seq_len=S, seed=0)
CUT = {"colwise": ("weight", "bias"), "vocab_head": ("weight", "bias"), "rowwise": ("weight",),
       "vocab_embedding": ("weight",)}

world = init_world()
counts = defaultdict(int)


def close(what, got, want):
    try:
        torch.testing.assert_close(got, want, **TOL)
    except AssertionError as e:
        raise AssertionError(f"{what} (world rank {world.rank}): {e}") from None


def cols(t, r, n, dim=-1, parts=1):
    """Rank r's slice of t along dim when dim holds ``parts`` equal parts, each split in n."""
    return torch.cat([c.narrow(dim, r * (c.shape[dim] // n), c.shape[dim] // n)
                      for c in t.chunk(parts, dim)], dim)


def pcols(t, r, n):
    """Rank r's rows of a vocabulary padded to a multiple of n, along the last dim."""
    v = t.shape[-1]
    c = -(-v // n)
    return t[..., min(r * c, v):min((r + 1) * c, v)]


def rand(*shape, seed):
    return torch.randn(shape, dtype=DT, generator=torch.Generator().manual_seed(seed))


# -- 1. adjoints ---------------------------------------------------------------------------

def adjoints(tp):
    n, k = tp.size, 3
    full, chunk = (2, n * k, 5), (2, k, 5)
    full4, chunk4 = (2, 3, n * k, 4), (2, 3, k, 4)  # dim -2 under two leading dims
    cases = [
        # gather / reduce-scatter / split map "one tensor per rank" spaces (or the sequence
        # chunks of one tensor) to each other: each is checked alone.
        ("gather_seq", lambda x: gather_seq(x, tp), chunk, full),
        ("reduce_scatter_seq", lambda x: reduce_scatter_seq(x, tp), full, chunk),
        ("split_seq", lambda x: split_seq(x, tp), full, chunk),
        ("gather_seq 4d", lambda x: gather_seq(x, tp), chunk4, full4),
        ("reduce_scatter_seq 4d", lambda x: reduce_scatter_seq(x, tp), full4, chunk4),
        ("split_seq 4d", lambda x: split_seq(x, tp), full4, chunk4),
        ("gather_seq dim=1", lambda x: gather_seq(x, tp, 1), chunk, full),
        # copy_to's input and reduce_from's output are replicated (one tensor that every
        # rank holds), which check_adjoint's independent per-rank tensors are not; composed
        # they map per-rank tensors to per-rank tensors (their sum on every rank), an
        # operator the check applies to (both orders).
        ("copy_to o reduce_from", lambda x: copy_to(reduce_from(x, tp), tp), full, full),
        ("reduce_from o copy_to", lambda x: reduce_from(copy_to(x, tp), tp), full, full),
        # gather_seq / reduce_scatter_seq are the sequence-parallel copy_to / reduce_from:
        ("gather_seq o reduce_scatter_seq",
         lambda x: gather_seq(reduce_scatter_seq(x, tp), tp), full, full),
        ("copy_to o reduce_from o gather_seq o reduce_scatter_seq",
         lambda x: copy_to(reduce_from(gather_seq(reduce_scatter_seq(x, tp), tp), tp), tp),
         full, full),
        ("reduce_scatter_seq o copy_to o reduce_from o gather_seq",
         lambda x: reduce_scatter_seq(copy_to(reduce_from(gather_seq(x, tp), tp), tp), tp),
         chunk, chunk),
        ("gather_seq o split_seq", lambda x: gather_seq(split_seq(x, tp), tp), full, full),
    ]
    for i, (name, f, xs, ys) in enumerate(cases):
        try:
            check_adjoint(f, xs, ys, tp, seed=i)
        except AssertionError as e:
            raise AssertionError(f"{name} over tp={n}: {e}") from None
        counts["adjoint"] += 1
    # The check has teeth: copy_to alone (its backward all-reduces) is not the adjoint of the
    # identity on independent per-rank tensors, so check_adjoint must reject it.
    try:
        check_adjoint(lambda x: copy_to(x, tp), full, full, tp, seed=99)
    except AssertionError:
        counts["adjoint rejected"] += 1
    else:
        raise AssertionError("check_adjoint accepted copy_to alone on per-rank inputs")


# -- 2. layers vs the unsplit module -------------------------------------------------------

def compare_grads(what, model, tensor, ref):
    """Every gradient of the split model, whole (slices assembled over tp, partial copies
    summed where the placement says so), equals the unsplit model's."""
    tp = tensor.tp
    named = dict(model.named_parameters(remove_duplicate=False))
    whole = tensor.assemble({k: p.grad for k, p in named.items()})
    ref_named = dict(ref.named_parameters(remove_duplicate=False))
    assert named.keys() == ref_named.keys(), (what, named.keys(), ref_named.keys())
    for k, pr in ref_named.items():
        g = whole[k]
        if k not in tensor.splits:
            assert g.shape == pr.shape, (what, k, g.shape, pr.shape)
            if any(c.name == "tp" and c.partial for c in placement_of(named[k]).copies):
                g = tp.allreduce(g.clone())
        close(f"{what}: grad of {k}", g, pr.grad)


def check_layer(what, ref, plan, sp, mesh, x, x_local, y_local, target=None):
    """ref and its split copy on x / x_local(x): outputs and gradients match.

    ``y_local`` maps the whole output (and its gradient) to this rank's part; with ``target``
    the output is logits and the loss the (vocabulary-parallel) lm_loss."""
    ref = ref.to(DT)
    ref.zero_grad(set_to_none=True)
    model, tensor = prepare(copy.deepcopy(ref), world, mesh,
                            TensorOptions(sequence_parallel=sp, plan=plan))
    what = f"{what} tp={tensor.tp.size} sp={'on' if sp else 'off'}"
    floating = x.is_floating_point()
    xr = x.clone().requires_grad_(floating)
    xl = x_local(x).clone().requires_grad_(floating)
    yr, yl = ref(xr), model(xl)
    close(f"{what}: output", yl, y_local(yr.detach()))
    if target is None:
        g = rand(*yr.shape, seed=5)
        yr.backward(g)
        yl.backward(y_local(g))
    else:
        lr, ll = lm_loss(yr, target), tensor.adapt_loss(lm_loss)(yl, target)
        close(f"{what}: loss", ll, lr.detach())
        lr.backward()
        ll.backward()
    if floating:
        close(f"{what}: input grad", xl.grad, x_local(xr.grad))
    compare_grads(what, model, tensor, ref)
    counts["layers"] += 1


def layers(mesh):
    tp = mesh.comm("tp")
    r, n = tp.rank, tp.size
    x = rand(B, S, H, seed=1)
    for sp in (False, True):
        seq = (lambda t: cols(t, r, n, dim=-2)) if sp else (lambda t: t)
        same = lambda t: t  # noqa: E731
        feat = lambda t: cols(t, r, n)  # noqa: E731
        for bias in (True, False):
            torch.manual_seed(10)
            lin = nn.Sequential(nn.Linear(H, 3 * H, bias=bias))
            check_layer(f"colwise bias={bias}", lin, {"0": "colwise"}, sp, mesh, x, seq, feat)
            fused = {"0": {"style": "colwise", "parts": 3, "heads": n}}
            check_layer(f"colwise qkv bias={bias}", lin, fused, sp, mesh, x, seq,
                        lambda t: cols(t, r, n, parts=3))
            torch.manual_seed(11)
            row = nn.Sequential(nn.Linear(2 * H, H, bias=bias))
            check_layer(f"rowwise bias={bias}", row, {"0": "rowwise"}, sp, mesh,
                        rand(B, S, 2 * H, seed=2), feat, seq)
        torch.manual_seed(12)
        mlp = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))
        check_layer("mlp colwise+rowwise", mlp, {"0": "colwise", "2": "rowwise"}, sp, mesh,
                    x, seq, seq)
        torch.manual_seed(13)
        vocab = 4 * 5
        idx = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(3))
        idx[0, :4] = torch.tensor([0, vocab // n - 1, vocab // n, vocab - 1])  # slice edges
        check_layer("vocab_embedding", nn.Sequential(nn.Embedding(vocab, H)),
                    {"0": "vocab_embedding"}, sp, mesh, idx, same, seq)
        torch.manual_seed(14)
        check_layer("position embedding (sequence_parallel)", nn.Sequential(nn.Embedding(S, H)),
                    {"0": "sequence_parallel"}, sp, mesh, torch.arange(S), same, seq)
        torch.manual_seed(15)
        head = nn.Sequential(nn.Linear(H, vocab, bias=False))
        tgt = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(4))
        check_layer("vocab_head + lm_loss", head, {"0": "vocab_head"}, sp, mesh, x, seq, feat,
                    target=tgt)
        conv1d(mesh, sp, x, seq, feat)
        padded_vocab(mesh, sp, x, seq)
        for dropout in (0.0, 0.1):
            gpt(mesh, sp, dropout)
    cross_entropy(tp)


def conv1d(mesh, sp, x, seq, feat):
    """Hugging Face Conv1D (weight (in, out)): column, fused qkv by whole heads, row."""
    from transformers.pytorch_utils import Conv1D

    r, n = mesh.comm("tp").rank, mesh.comm("tp").size
    torch.manual_seed(16)
    qkv = nn.Sequential(Conv1D(3 * H, H))
    nn.init.normal_(qkv[0].bias)
    check_layer("conv1d colwise", qkv, {"0": "colwise"}, sp, mesh, x, seq, feat)
    check_layer("conv1d colwise qkv", qkv, {"0": {"style": "colwise", "parts": 3, "heads": n}},
                sp, mesh, x, seq, lambda t: cols(t, r, n, parts=3))
    torch.manual_seed(17)
    row = nn.Sequential(Conv1D(H, 2 * H))
    nn.init.normal_(row[0].bias)
    check_layer("conv1d rowwise", row, {"0": "rowwise"}, sp, mesh, rand(B, S, 2 * H, seed=2),
                feat, seq)


def padded_vocab(mesh, sp, x, seq):
    """A vocabulary of 23 (no tp divides it): rank r holds rows [r c, (r+1) c) that exist,
    c = ceil(23 / tp); the embedding's padding_idx row gets no gradient on its owner."""
    r, n = mesh.comm("tp").rank, mesh.comm("tp").size
    vocab, c = 23, -(-23 // n)
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, vocab, (B, S), generator=g)
    idx[0, :4] = torch.tensor([c - 1, c, vocab - 1, 5])  # slice edges, the padding row
    torch.manual_seed(18)
    check_layer("padded vocab_embedding padding_idx=5", nn.Sequential(
        nn.Embedding(vocab, H, padding_idx=5)), {"0": "vocab_embedding"}, sp, mesh, idx,
        lambda t: t, seq)
    torch.manual_seed(19)
    head = nn.Sequential(nn.Linear(H, vocab))
    tgt = torch.randint(0, vocab, (B, S), generator=g)
    tgt[0, :3] = torch.tensor([c - 1, c, vocab - 1])
    check_layer("padded vocab_head + lm_loss", head, {"0": "vocab_head"}, sp, mesh, x, seq,
                lambda t: pcols(t, r, n), target=tgt)


def cross_entropy(tp):
    """vocab_parallel_cross_entropy on this rank's logit columns vs F.cross_entropy."""
    r, n = tp.rank, tp.size
    V = 6 * n
    for i, (shape, scale) in enumerate((((12,), 1.0), ((B, S), 1.0), ((B, S), 40.0))):
        logits = rand(*shape, V, seed=20 + i) * scale
        tgt = torch.randint(0, V, shape, generator=torch.Generator().manual_seed(30 + i))
        flat = tgt.view(-1)
        flat[:4] = torch.tensor([0, V // n - 1, V // n, V - 1])  # the slice boundaries
        lr = logits.clone().requires_grad_()
        ref = F.cross_entropy(lr.reshape(-1, V), tgt.reshape(-1))
        ref.backward()
        ll = cols(logits, r, n).requires_grad_()
        rec = Recording(tp)
        loss = vocab_parallel_cross_entropy(ll, tgt, rec, r * (V // n))
        fwd, rec.log = rec.log, []
        loss.backward()
        what = f"vocab_parallel_cross_entropy {shape}x{V} scale={scale} tp={n}"
        # Megatron's: the max, then the sum of exponentials with the target logit, per
        # token; the gradient is local
        tokens = tgt.numel()
        assert [c[:2] for c in fwd] == [("allreduce", tokens), ("allreduce", 2 * tokens)] \
            and not rec.log, f"{what}: collectives {fwd} forward, {rec.log} backward"
        close(f"{what}: loss", loss, ref.detach())
        close(f"{what}: logits grad", ll.grad, cols(lr.grad, r, n))
        counts["cross-entropy"] += 1


def make_gpt(dropout):
    return GPT(**GPT_KW, dropout=dropout).to(DT)


def gpt(mesh, sp, dropout):
    """A whole GPT (tied embedding/head, every style of its plan) in training mode: logits,
    loss and every gradient equal one process's for the same seed."""
    tp = mesh.comm("tp")
    r, n = tp.rank, tp.size
    ref = make_gpt(dropout).train()
    model, tensor = prepare(copy.deepcopy(ref), world, mesh, TensorOptions(sequence_parallel=sp))
    what = f"gpt dropout={dropout} tp={n} sp={'on' if sp else 'off'}"
    g = torch.Generator().manual_seed(6)
    idx = torch.randint(0, GPT_KW["vocab"], (B, S), generator=g)
    tgt = torch.randint(0, GPT_KW["vocab"], (B, S), generator=g)
    torch.manual_seed(1234)
    logits_r = ref(idx)
    loss_r = lm_loss(logits_r, tgt)
    loss_r.backward()
    torch.manual_seed(1234)
    logits = model(idx)
    loss = tensor.adapt_loss(lm_loss)(logits, tgt)
    loss.backward()
    close(f"{what}: logits", logits, cols(logits_r.detach(), r, n))
    close(f"{what}: loss", loss, loss_r.detach())
    compare_grads(what, model, tensor, ref)
    if dropout:  # the masks were drawn: another seed gives other logits
        torch.manual_seed(99)
        with torch.no_grad():
            other = ref(idx)
        assert (other - logits_r).abs().max() > 1e-3, what
        counts["dropout"] += 1
    counts["gpt"] += 1


# -- 3. the collectives of one transformer block -------------------------------------------

class MeshWithTP:
    """The mesh with its tp communicator swapped for another (a Recording)."""

    def __init__(self, mesh, tp):
        self._mesh, self._tp = mesh, tp
        self.coords = mesh.coords

    def comm(self, dim):
        return self._tp if dim == "tp" else self._mesh.comm(dim)

    def size(self, dim):
        return self._mesh.size(dim)


class Recording:
    """The tp communicator, every method call logged as (name, whole elements, bytes on the
    wire per rank of a ring algorithm); only rank, size and device are read unlogged."""

    def __init__(self, comm):
        self._comm = comm
        self.rank, self.size, self.device = comm.rank, comm.size, comm.device
        self.log = []

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            t = args[0] if args and torch.is_tensor(args[0]) else None
            n, e = self.size, t.element_size() if t is not None else 0
            whole = {"allgather": t.numel() * n if t is not None else 0}.get(
                name, t.numel() if t is not None else 0)
            # bytes each rank sends (Thakur/Patarasuk ring): all-reduce 2(n-1)/n of the
            # tensor, all-gather and reduce-scatter (n-1)/n of the whole tensor each.
            wire = {"allreduce": 2 * (n - 1) * whole * e // n}.get(name, (n - 1) * whole * e // n)
            self.log.append((name, whole, wire))
            return attr(*args, **kwargs)
        return call


def block_plan(heads):
    """The gpt plan's block patterns, for one GPTBlock on its own."""
    plan = {k.removeprefix("blocks.*."): v for k, v in tp_plan(heads).items()
            if k.startswith("blocks.*.")}
    assert len(plan) == 9, plan  # ln1 ln2 drop1 drop2 qkv attn.drop proj mlp.0 mlp.2
    return plan


def block_collectives(mesh):
    tp = mesh.comm("tp")
    n = tp.size
    heads = 4
    plan = block_plan(heads)
    N = B * S * H
    want = {False: (["allreduce"] * 2, ["allreduce"] * 2),
            True: (["allgather", "reduce_scatter"] * 2, ["allgather", "reduce_scatter"] * 2)}
    wire = {}
    for sp in (False, True):
        for dropout in (0.0, 0.1):
            torch.manual_seed(7)
            block = GPTBlock(H, heads, dropout=dropout).to(DT).train()
            rec = Recording(tp)
            block, _ = prepare(block, world, MeshWithTP(mesh, rec), TensorOptions(sp, plan))
            assert not rec.log, rec.log  # splitting communicates nothing
            x = rand(B, S, H, seed=8)
            x = (cols(x, tp.rank, n, dim=-2) if sp else x).requires_grad_()
            torch.manual_seed(9)
            y = block(x)
            fwd, rec.log = rec.log, []
            y.backward(torch.ones_like(y))
            bwd = rec.log
            what = f"block tp={n} sp={'on' if sp else 'off'} dropout={dropout}"
            for phase, got, names in (("forward", fwd, want[sp][0]),
                                      ("backward", bwd, want[sp][1])):
                expect = [(name, N) for name in names]
                assert [(name, k) for name, k, _ in got] == expect, \
                    f"{what} {phase}: collectives {got}, Megatron's are {expect}"
            wire[sp] = sum(b for _, _, b in fwd + bwd)
            counts["block collectives"] += 1
    # Megatron (Korthikanti et al. 2022): the all-gather + reduce-scatter of sequence
    # parallel move the bytes of the all-reduce they replace: 4 all-reduces of b*s*h per block.
    megatron = 4 * 2 * (n - 1) * N * 8 // n
    assert wire[False] == wire[True] == megatron, (wire, megatron)


# -- 4. memory ------------------------------------------------------------------------------

def matches(pattern, name):
    p, m = pattern.split("."), name.split(".")
    return len(p) == len(m) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(m, p))


def param_bytes(mesh):
    """Local parameter bytes after the split = cut parameters / tp + replicated ones, from
    the unsplit model's parameter list and the plan (tied parameters counted once)."""
    n = mesh.comm("tp").size
    for kw in ({}, {"heads": 8, "layers": 3}):
        ref = GPT(**{**GPT_KW, **kw})
        plan = ref.tp_plan
        expect, seen = 0, set()
        for mname, module in ref.named_modules():
            styles = [v if isinstance(v, str) else v["style"] for p, v in plan.items()
                      if matches(p, mname)]
            assert len(styles) <= 1, (mname, styles)
            for pname, p in module.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                cut = bool(styles) and pname in CUT.get(styles[0], ())
                assert not cut or p.numel() % n == 0
                expect += (p.numel() // n if cut else p.numel()) * p.element_size()
        whole = nbytes(list(ref.parameters()))
        for sp in (False, True):
            model, _ = prepare(copy.deepcopy(ref), world, mesh, TensorOptions(sp))
            got = nbytes(list(model.parameters()))
            assert got == expect, f"tp={n} sp={sp} {kw}: {got} local parameter bytes, " \
                                  f"expected {expect} (whole model {whole})"
            assert got < whole
            counts["param bytes"] += 1


def saved_bytes(mesh, sp, regions=("ln1", "ln2", "drop1", "drop2")):
    """Bytes of activations saved for backward inside each region of a GPTBlock with
    dropout, forward in training mode (parameters saved by an op are not activations)."""
    tp = mesh.comm("tp")
    torch.manual_seed(7)
    block = GPTBlock(H, 4, dropout=0.1).to(DT).train()
    block, _ = prepare(block, world, mesh, TensorOptions(sp, block_plan(4)))
    params = {p.data_ptr() for p in block.parameters()}
    where, saved = [None], defaultdict(int)
    for name in regions:
        mod = block.get_submodule(name)
        mod.register_forward_pre_hook(lambda m, a, name=name: where.__setitem__(0, name))
        mod.register_forward_hook(lambda m, a, out: where.__setitem__(0, None))

    def pack(t):
        if where[0] is not None and t.data_ptr() not in params:
            saved[where[0]] += t.numel() * t.element_size()
        return t

    x = rand(B, S, H, seed=8)
    x = (cols(x, tp.rank, tp.size, dim=-2) if sp else x).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x)
    y.sum().backward()  # the saved tensors were usable
    return saved


def activation_memory(mesh):
    n = mesh.comm("tp").size
    off, on = saved_bytes(mesh, False), saved_bytes(mesh, True)
    assert set(off) == set(on) == {"ln1", "ln2", "drop1", "drop2"}, (off, on)
    for region in sorted(off) + ["all"]:
        a = sum(off.values()) if region == "all" else off[region]
        b = sum(on.values()) if region == "all" else on[region]
        assert b > 0 and abs(a / b - n) <= 0.1 * n, \
            f"tp={n} {region}: saved {a} bytes without sequence parallel, {b} with; " \
            f"expected a factor {n}"
        counts["activation regions"] += 1
    return sum(off.values()), sum(on.values())


def main():
    n = world.size
    layouts = [MeshLayout(tp=n, dp=1)] + ([MeshLayout(tp=2, dp=2)] if n == 4 else [])
    notes = []
    for layout in layouts:
        mesh = world.mesh(layout)
        adjoints(mesh.comm("tp"))
        layers(mesh)
        block_collectives(mesh)
        param_bytes(mesh)
        off, on = activation_memory(mesh)
        notes.append(f"tp={layout.tp}: LN+dropout saved {off} -> {on} bytes")
    world.comm.barrier()
    if world.rank == 0:
        print(f"tensor adjoints ok: {counts['adjoint']} operators, "
              f"{counts['adjoint rejected']} rejected")
        print(f"tensor layers ok: {counts['layers']} layers, {counts['cross-entropy']} "
              f"cross-entropies, {counts['gpt']} gpts ({counts['dropout']} with dropout)")
        print(f"tensor collectives ok: {counts['block collectives']} blocks")
        print(f"tensor memory ok: {counts['param bytes']} splits, "
              f"{counts['activation regions']} regions; {'; '.join(notes)}")
        print(f"tensor worker done on {n} ranks")
    sys.stdout.flush()


main()
