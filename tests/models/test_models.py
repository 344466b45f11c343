"""Built-in models, the awkward fixture and the registry: determinism, ties, causality,
learning, and the promised error messages."""

import math

import pytest
import torch
from torch import nn

from hpctrain.data import GlobalBatchSampler, collate
from hpctrain.models import BUILTIN, GPTBlock, build, describe

AWKWARD = "tests.fixtures.awkward:factory"
HERE = "tests.models.test_models"


# Deliberately broken user factories (loaded by spec from this module).
def bad_two_tuple():
    return nn.Linear(2, 2), [(torch.zeros(2), torch.zeros(2))]


def bad_model():
    return "not a module", [(torch.zeros(2), torch.zeros(2))], lambda o, t: o


def bad_dataset():
    return nn.Linear(2, 2), object(), lambda o, t: o


def bad_loss():
    return nn.Linear(2, 2), [(torch.zeros(2), torch.zeros(2))], 3


def bad_item():
    return nn.Linear(2, 2), [torch.zeros(2)], lambda o, t: o


NOT_CALLABLE = 42


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _data(ds):
    return collate(ds, torch.arange(len(ds)))


@pytest.mark.parametrize("spec", ["mlp", "gpt", AWKWARD])
def test_same_seed_same_model_and_data(spec):
    a, b, c = build(spec, 7), build(spec, 7), build(spec, 8)
    pa, pb, pc = _params(a.model), _params(b.model), _params(c.model)
    assert pa.keys() == pb.keys()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    # Random-initialised weights (not the constant biases / LayerNorm scales) follow the seed.
    random = [k for k, p in a.model.named_parameters() if p.requires_grad and p.dim() >= 2]
    assert random and not any(torch.equal(pa[k], pc[k]) for k in random)
    for x, y in zip(_data(a.dataset), _data(b.dataset)):
        assert torch.equal(x, y)
    if spec in BUILTIN:  # built-in data follows the seed; the fixture's is fixed in its file
        assert not torch.equal(_data(a.dataset)[0], _data(c.dataset)[0])


def test_build_leaves_global_rng_alone():
    state = torch.get_rng_state()
    build("gpt", 1)
    build(AWKWARD, 1)
    assert torch.equal(state, torch.get_rng_state())


def test_units_and_sample_shapes():
    g = build("gpt", 0, seq_len=16, n_samples=64)
    assert (g.unit, g.units_per_sample, g.name) == ("tokens", 16, "gpt")
    x, y = g.dataset[3]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16,)
    assert torch.equal(x[1:], y[:-1])  # target is the input shifted by one
    m = build("mlp", 0, n_samples=100)
    assert (m.unit, m.units_per_sample, len(m.dataset)) == ("samples", 1, 100)
    assert m.dataset[0][0].shape == (37,) and m.dataset[0][1].dtype == torch.int64
    assert len(m.dataset.targets.unique()) > 3  # the teacher uses several classes
    a = build(AWKWARD, 0)
    assert (a.unit, a.units_per_sample, a.name) == ("samples", 1, AWKWARD)


def test_default_sizes_are_uneven():
    m = build("mlp", 0).model
    assert m.stem.in_features == 37 and m.head.out_features == 11
    assert m.stem.out_features == 83 and len(m.blocks) == 3
    assert isinstance(m.blocks, nn.ModuleList)
    g = build("gpt", 0).model
    assert isinstance(g.blocks, nn.ModuleList) and all(isinstance(b, GPTBlock) for b in g.blocks)
    assert g.tok_emb.num_embeddings == 67 and len(g.blocks) == 2


def test_gpt_head_is_tied_to_embedding():
    model = build("gpt", 0).model
    assert model.head.weight is model.tok_emb.weight
    params = list(model.parameters())
    assert sum(p is model.tok_emb.weight for p in params) == 1
    assert len({id(p) for p in params}) == len(params)
    assert "head.weight" not in dict(model.named_parameters())
    # Gradients from both uses land in the one Parameter.
    x = torch.randint(67, (2, 8))
    model(x).sum().backward()
    assert model.tok_emb.weight.grad is not None and model.head.weight.grad is not None


def test_gpt_is_causal():
    model = build("gpt", 3).model.eval()
    x = torch.randint(67, (2, 32), generator=torch.Generator().manual_seed(0))
    x2 = x.clone()
    x2[:, 20] = (x2[:, 20] + 1) % 67
    with torch.no_grad():
        a, b = model(x), model(x2)
    assert torch.allclose(a[:, :20], b[:, :20], atol=1e-6)
    assert not torch.allclose(a[:, 20:], b[:, 20:], atol=1e-4)


@pytest.mark.parametrize("spec", ["mlp", "gpt", AWKWARD])
def test_empty_batch_forward(spec):
    # A rank may get an empty micro-batch; forward and loss must still run.
    b = build(spec, 0)
    x, y = collate(b.dataset, [])
    out = b.model(x)
    assert out.shape[0] == 0


@pytest.mark.parametrize("spec, steps, options", [
    ("mlp", 40, dict(n_samples=1024)),
    ("gpt", 40, dict(n_samples=256)),
    (AWKWARD, 40, {}),
])
def test_loss_falls_with_adam(spec, steps, options):
    torch.manual_seed(0)
    b = build(spec, 0, **options)
    sampler = GlobalBatchSampler(len(b.dataset), 32, 0, 0, 1)
    probe = collate(b.dataset, torch.arange(128))  # fixed evaluation batch

    def probe_loss():
        with torch.no_grad():
            return b.loss_fn(b.model(probe[0]), probe[1]).item()

    before = probe_loss()
    opt = torch.optim.Adam([p for p in b.model.parameters() if p.requires_grad], lr=3e-3)
    for step in range(steps):
        x, y = collate(b.dataset, sampler.micro_batches(step)[0])
        opt.zero_grad()
        b.loss_fn(b.model(x), y).backward()
        opt.step()
    after = probe_loss()
    assert after < 0.8 * before, (before, after)
    if spec == "gpt":
        assert before > 0.95 * math.log(67)  # starts near uniform
        assert after < 0.7 * math.log(67)


def test_awkward_fixture_corner_cases():
    b = build(AWKWARD, 0)
    m = b.model
    assert m.mid2.weight is m.mid1.weight  # tied
    assert "in_scale" in m.state_dict() and "in_scale" not in dict(m.named_parameters())
    assert not m.gain.requires_grad
    for name, p in m.named_parameters():
        assert p.numel() % 2 and p.numel() % 3, name
    x, y = collate(b.dataset, torch.arange(16))
    b.loss_fn(m(x), y).backward()
    assert m.unused.grad is None and m.gain.grad is None and m.mid1.weight.grad is not None
    bn = build("tests.fixtures.awkward:factory_batchnorm", 0).model
    assert isinstance(bn.bn, nn.BatchNorm1d) and "bn.running_mean" in bn.state_dict()


def test_describe_and_builtin_names():
    assert set(BUILTIN) == {"mlp", "gpt", "unet"}
    lines = describe().splitlines()
    assert len(lines) == len(BUILTIN)
    assert all(line.startswith(f"{name}:") for line, name in zip(lines, sorted(BUILTIN)))


@pytest.mark.parametrize("spec, options, words", [
    ("resnet", {}, ["'resnet'", "mlp", "gpt", "package.module:factory"]),
    ("__import__('os').getcwd()", {}, ["unknown model"]),
    ("no_such_pkg_xyz.mod:factory", {}, ["cannot import module", "no_such_pkg_xyz.mod",
                                         "PYTHONPATH"]),
    ("tests.fixtures.awkward:nope", {}, ["has no attribute", "'nope'"]),
    (f"{HERE}:NOT_CALLABLE", {}, ["not a callable"]),
    (f"{HERE}:bad_two_tuple", {}, ["2-tuple", "3-tuple"]),
    (f"{HERE}:bad_model", {}, ["torch.nn.Module"]),
    (f"{HERE}:bad_dataset", {}, ["__len__/__getitem__"]),
    (f"{HERE}:bad_loss", {}, ["expected a callable"]),
    (f"{HERE}:bad_item", {}, ["(input, target) pair"]),
    ("a:b:c", {}, ["malformed"]),
    (":factory", {}, ["malformed"]),
    ("tests.fixtures.awkward:", {}, ["malformed"]),
    ("mlp", dict(widht=3), ["widht", "accepted options", "hidden"]),
    (AWKWARD, dict(hidden=3), ["only accepted by built-in"]),
])
def test_registry_errors(spec, options, words):
    with pytest.raises(ValueError) as err:
        build(spec, 0, **options)
    msg = str(err.value)
    assert repr(spec) in msg or spec in msg
    for w in words:
        assert w in msg, (w, msg)
