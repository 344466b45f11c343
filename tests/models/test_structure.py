"""The one definition of a model's blocks, and the ties a Sequential's layers share."""

from torch import nn

from hpctrain.models.gpt import GPT
from hpctrain.models.layers import from_sequential
from hpctrain.models.mlp import MLP
from hpctrain.models.structure import find_blocks
from tests.fixtures import resnetish, tied_seq, vitish
from tests.fixtures.awkward import AwkwardNet


def _names(model):
    return [n for n, _ in find_blocks(model)]


def test_blocks_of_modulelists_and_of_sequentials_of_repeated_classes():
    assert _names(GPT(layers=3)) == ["blocks.0", "blocks.1", "blocks.2"]
    assert _names(MLP()) == ["blocks.0", "blocks.1", "blocks.2"]
    # torchvision ResNet: BasicBlocks in Sequential stages; the stem's BatchNorm is no block.
    assert _names(resnetish.ResNetish()) == resnetish.BLOCKS
    # timm ViT: Blocks in a Sequential; cls/pos tokens, norm and head stay outside.
    assert _names(vitish.ViTish()) == [f"blocks.{i}" for i in range(vitish.DEPTH)]
    # GPT as one Sequential: the blocks repeat, the embedding and the head do not.
    assert _names(tied_seq.build()) == ["1", "2"]


def test_blocks_do_not_nest_and_need_a_repeated_class_with_parameters():
    # Inside a block, GPTBlock.mlp (Linear, GELU, Linear) is part of the block.
    assert not any(".mlp" in n for n in _names(GPT()))
    assert _names(nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.ReLU(), nn.Linear(3, 2))) == ["0", "3"]
    assert _names(nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.LayerNorm(3))) == []
    assert _names(AwkwardNet()) == []


def test_from_sequential_declares_parameters_shared_across_layers():
    stack = from_sequential(tied_seq.build())
    assert [layer.name for layer in stack.layers] == ["0", "1", "2", "3"]
    assert stack.tied == {"3.out.weight": "0.tok.weight"}
    # A module used twice is a layer each time, its parameters tied to the first use.
    shared = nn.Linear(4, 4)
    stack = from_sequential(nn.Sequential(shared, nn.Tanh(), shared))
    assert [layer.name for layer in stack.layers] == ["0", "1", "2"]
    assert stack.tied == {"2.weight": "0.weight", "2.bias": "0.bias"}
    whole = stack.build(range(3))
    assert whole.get_parameter("2.weight") is whole.get_parameter("0.weight")
