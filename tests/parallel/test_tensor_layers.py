"""Tensor parallel and sequence parallel (parallel/tensor) vs one process.

Under mpirun (at 2 ranks and at 4, in the session's launches; tensor_layers_worker.py runs
every case):
the exact adjoints of the communicating Functions, the split layers and a whole GPT equal
the unsplit ones forward and backward in float64 (sequence parallel off and on, dropout
included), a transformer block issues exactly Megatron's collectives, and the split saves
the parameter and activation memory it should.

Without MPI: every bad plan or size fails in ``prepare`` with one line naming what and why,
before any communication and before the model is touched.
"""

import os
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.models.gpt import GPT, tp_plan
from hpctrain.parallel.tensor import TensorOptions, TensorParallel, prepare
from hpctrain.parallel.tensor.loss import vocab_parallel_cross_entropy
from hpctrain.parallel.tensor.ops import reduce_scatter_seq, split_seq
from tests.parallel.train_cases import pooled_script

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "tensor_layers_worker.py")
RANKS = (2, 4)

# the worker runs in the session's launches (tests/parallel/train_cases.py)
runs = pooled_script(__name__, WORKER, RANKS)


@pytest.mark.mpi
@pytest.mark.parametrize("n", RANKS)
def test_tensor_parallel_matches_one_process(runs, n):
    out = runs[f"n{n}"]["stdout"]  # rank 0's; the worker's assertions abort its launch
    meshes = 1 if n == 2 else 2  # tp=n; at 4 ranks also tp=2 x dp=2
    assert f"tensor worker done on {n} ranks" in out, out
    assert f"tensor adjoints ok: {13 * meshes} operators, {meshes} rejected" in out, out
    assert (f"tensor layers ok: {30 * meshes} layers, {3 * meshes} cross-entropies, "
            f"{4 * meshes} gpts ({2 * meshes} with dropout)") in out, out
    assert f"tensor collectives ok: {4 * meshes} blocks" in out, out
    assert f"tensor memory ok: {4 * meshes} splits, {5 * meshes} regions" in out, out


# -- bad input, no MPI ---------------------------------------------------------------------

class _Comm:
    """A tp group of ``size`` seen from rank 0 that must not be used: prepare checks
    everything before it communicates."""

    def __init__(self, size):
        self.rank, self.size, self.device = 0, size, torch.device("cpu")

    def __getattr__(self, name):
        raise AssertionError(f"prepare used the communicator ({name}) before its checks")


class _Mesh:
    def __init__(self, tp):
        self.tp = _Comm(tp)
        self.coords = {"pp": 0, "dp": 0, "dom": 0, "tp": 0}

    def comm(self, dim):
        assert dim == "tp", dim
        return self.tp

    def size(self, dim):
        return self.tp.size if dim == "tp" else 1


_WORLD = SimpleNamespace(device=torch.device("cpu"), rank=0, size=1)


def _mlp(hidden=30, inner=12):
    return nn.Sequential(nn.Linear(12, hidden), nn.GELU(), nn.Linear(inner, 12))


BAD = {
    "heads": (lambda: GPT(vocab=72, d_model=48, heads=6), 4, None,
              "tensor parallel over tp=4: module 'blocks.0.attn.qkv' (colwise): 6 attention "
              "heads do not split over tp=4; use a head count divisible by tp"),
    "hidden-fused-qkv": (lambda: GPT(vocab=72, d_model=18, heads=2), 4, None,
                         "tensor parallel over tp=4: module 'blocks.0.attn.qkv' (colwise): 18 "
                         "output features per part (3 parts) do not split over tp=4; use sizes "
                         "divisible by tp"),
    "hidden-colwise": (_mlp, 4, {"0": "colwise", "2": "rowwise"},
                       "tensor parallel over tp=4: module '0' (colwise): 30 output features do "
                       "not split over tp=4; use sizes divisible by tp"),
    "hidden-rowwise": (lambda: _mlp(hidden=10, inner=10), 4, {"2": "rowwise"},
                       "tensor parallel over tp=4: module '2' (rowwise): 10 input features do "
                       "not split over tp=4; use sizes divisible by tp"),
    "vocab-too-small": (lambda: GPT(vocab=5), 4, None,
                        "tensor parallel over tp=4: module 'tok_emb' (vocab_embedding): a "
                        "vocabulary of 5 padded to a multiple of tp (2 rows per rank) leaves the "
                        "last of the tp=4 ranks no rows; use a smaller tp or a larger "
                        "vocabulary"),
    "max-norm": (lambda: nn.Sequential(nn.Embedding(8, 4, max_norm=1.0)), 2,
                 {"0": "vocab_embedding"},
                 "tensor parallel over tp=2: module '0' (vocab_embedding): a max_norm embedding "
                 "renormalises the rows it looks up, which a split cannot do as one process; "
                 "set max_norm=None or give it no style"),
    "per-rank-without-the-attribute": (_mlp, 2, {"0": {"style": "per_rank",
                                                       "divide": ["num_heads"]}},
                                       "tensor parallel over tp=2: module '0' (per_rank): "
                                       "Linear has no integer attribute 'num_heads' (got None); "
                                       "name the attributes that count what tp splits (heads, "
                                       "features) in 'divide'"),
    "per-rank-not-dividing": (_mlp, 4, {"0": {"style": "per_rank", "divide": ["out_features"]}},
                              "tensor parallel over tp=4: module '0' (per_rank): out_features "
                              "= 30 does not split over tp=4; use sizes divisible by tp"),
    "per-rank-without-divide": (_mlp, 2, {"0": "per_rank"},
                                "tensor plan entry '0': per_rank needs 'divide', a list of the "
                                "module's integer attributes that tp divides (e.g. "
                                "[\"num_heads\"]), got []"),
    "pattern-matches-nothing": (lambda: GPT(vocab=68), 2,
                                {**tp_plan(4), "blocks.*.attn.qkvv": "colwise"},
                                "tensor plan pattern 'blocks.*.attn.qkvv' matches no module of "
                                "the model; module names look like tok_emb, pos_emb, blocks"),
    "no-plan": (_mlp, 2, None,
                "tensor parallel (tp=2): the model Sequential has no tensor-parallel plan; give "
                "one in [tensor.plan] (module-name patterns -> colwise, rowwise, "
                "vocab_embedding, vocab_head, sequence_parallel, attention_dropout, per_rank) or "
                "use tp=1"),
    "colwise-on-layernorm": (lambda: GPT(vocab=68), 2, {**tp_plan(4), "blocks.*.ln1": "colwise"},
                             "tensor plan: style colwise applies to torch.nn.Linear or a Hugging "
                             "Face Conv1D, but module 'blocks.0.ln1' is a LayerNorm; give it "
                             "another style or none"),
    "attention-dropout-on-linear": (_mlp, 2, {"0": "attention_dropout"},
                                    "tensor plan: style attention_dropout applies to "
                                    "hpctrain.models.dropout.Dropout, but module '0' is a Linear; "
                                    "give it another style or none"),
    "tied-cut-two-ways": (lambda: GPT(vocab=68), 2, {**tp_plan(4), "head": "rowwise"},
                          "tensor plan: parameter head.weight is tied to tok_emb.weight but "
                          "their styles cut it differently; give the tied modules matching "
                          "styles (vocab_embedding with vocab_head)"),
    "unknown-style": (_mlp, 2, {"0": "columnwise"},
                      "tensor plan entry '0': unknown style 'columnwise'; expected one of "
                      "colwise, rowwise, vocab_embedding, vocab_head, sequence_parallel, "
                      "attention_dropout, per_rank"),
    "parts-on-rowwise": (_mlp, 2, {"2": {"style": "rowwise", "parts": 2}},
                         "tensor plan entry '2': parts/heads apply to the colwise style only, "
                         "not rowwise"),
    "two-patterns": (_mlp, 2, {"0": "colwise", "*": "rowwise"},
                     "module '0' is matched by tensor plan patterns '0' and '*'; give it one "
                     "style"),
    "torch-dropout": (lambda: nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)), 2,
                      {"1": "sequence_parallel"},
                      "tensor parallel over tp=2: module '1' (sequence_parallel): torch's "
                      "nn.Dropout draws masks that depend on the split; use "
                      "hpctrain.models.dropout.Dropout"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_plans_fail_in_one_line_before_touching_the_model(case):
    make, tp, plan, message = BAD[case]
    model = make()
    before = {k: (type(model.get_submodule(k.rpartition(".")[0])), tuple(v.shape))
              for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as err:
        prepare(model, _WORLD, _Mesh(tp), TensorOptions(plan=plan or {}))
    text = str(err.value)
    assert text == message
    assert "\n" not in text
    after = {k: (type(model.get_submodule(k.rpartition(".")[0])), tuple(v.shape))
             for k, v in model.state_dict().items()}
    assert after == before  # nothing split, no class swapped


def test_sequence_parallel_with_a_hugging_face_plan_is_refused():
    from tests.fixtures.hf_models import gpt2_tp_factory

    model = gpt2_tp_factory()[0]
    with pytest.raises(ValueError, match=r"tensor parallel over tp=2: tensor.sequence_parallel "
                       r"= true is not supported with the plan of a Hugging Face model "
                       r"\(GPT2Logits\)"):
        prepare(model, _WORLD, _Mesh(2), TensorOptions(sequence_parallel=True))


@pytest.mark.parametrize("op, message", [
    (split_seq, "sequence parallel: sequence length 7 does not split over tp=2; use a "
                "sequence length divisible by tp"),
    (reduce_scatter_seq, "sequence parallel: dim -2 of size 7 does not split over tp=2; use a "
                         "sequence length divisible by tp"),
])
def test_a_sequence_that_does_not_split_is_one_line_before_communicating(op, message):
    with pytest.raises(ValueError, match=re.escape(message) + r"\Z"):
        op(torch.zeros(2, 7, 3), _Comm(2))


def test_a_loss_that_is_not_cross_entropy_is_refused_for_a_vocab_head():
    from hpctrain.parallel.tensor import check

    with pytest.raises(ValueError, match=r"the loss mse_loss is not marked as one\. Mark a mean "
                                         r"token cross-entropy with `mse_loss\.cross_entropy = "
                                         r"True`, or give the head another style\Z"):
        check(GPT(vocab=68), None, 2, F.mse_loss)
    state = TensorParallel(_Comm(2), False, {}, vocab=68, dp_rank=0, dp_size=1)
    with pytest.raises(ValueError, match="cannot run on vocabulary-parallel logits"):
        state.adapt_loss(F.mse_loss)


class _One:
    """A tp group of one: its all-reduces are the identity."""

    rank, size = 0, 1

    def allreduce(self, t, op="sum"):
        return t


@pytest.mark.parametrize("dtype, loss_dtype, tol", [
    (torch.float64, torch.float64, 1e-14),   # float64 logits are not rounded to float32
    (torch.float32, torch.float32, 1e-6),
    (torch.bfloat16, torch.float32, 1e-6),   # half logits: the softmax runs in float32
])
def test_vocab_parallel_cross_entropy_precision(dtype, loss_dtype, tol):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(12, 10, generator=g, dtype=torch.float64) * 5).to(dtype)
    tgt = torch.randint(0, 10, (12,), generator=g)
    x = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, tgt, _One(), 0)
    loss.backward()
    ref_x = logits.double().requires_grad_()
    ref = F.cross_entropy(ref_x, tgt)
    ref.backward()
    assert loss.dtype == loss_dtype and x.grad.dtype == dtype
    assert abs(loss.item() - ref.item()) <= tol * abs(ref.item())
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=0,
                               atol=tol if dtype != torch.bfloat16 else 1e-2)


def test_vocab_parallel_cross_entropy_ignores_padding_as_torch_does():
    # targets of -100 (Hugging Face labels at padding) count neither in the mean nor in
    # the gradient; a batch of padding only gives 0 (not NaN), still a function of the logits
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(12, 10, generator=g, dtype=torch.float64)
    tgt = torch.randint(0, 10, (12,), generator=g)
    tgt[[1, 5, 6]] = -100
    x = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, tgt, _One(), 0)
    loss.backward()
    ref_x = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_x, tgt)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-14 * abs(ref.item())
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=1e-15)
    x.grad = None
    none = vocab_parallel_cross_entropy(x, torch.full((12,), -100), _One(), 0)
    none.backward()
    assert none.item() == 0.0 and x.grad is not None and not x.grad.any()
