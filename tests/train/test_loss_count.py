"""What a loss averages over, measured on the first samples for tokens weighting
(train/loss_count.py): the count as given, the shifted count of a Hugging Face style loss
(used and said), or neither (one error line). Pure: no MPI (the trained equivalence is in
tests/parallel/test_pipeline_any_model.py)."""

import pytest
import torch

from hpctrain.errors import UsageError
from hpctrain.models.gpt import lm_loss
from hpctrain.models.registry import build_layers
from hpctrain.train.loss_count import check_loss_count, measured_count
from hpctrain.train.weighting import LossWeighting
from tests.fixtures import hf_models


def test_measured_count_reads_the_gradient_of_the_output():
    y = torch.tensor([[1, 2, 3, -100], [4, 5, -100, -100]])
    logits = torch.randn(2, 4, 7)
    assert measured_count(lm_loss, logits, y) == 5
    assert measured_count(hf_models.shifted_lm_loss, logits, y) == 3
    assert measured_count(lambda out, t: lm_loss(out["logits"], t), {"logits": logits}, y) == 5
    assert measured_count(lm_loss, torch.randn(8, 7), y) is None  # does not line up


def test_a_shifting_loss_is_found_declared_or_refused():
    model, data, loss = hf_models.gpt2_shifted_uncounted_factory()
    tokens = LossWeighting("tokens")
    note = check_loss_count(tokens, model, data, loss)
    assert "the loss shifts its labels (Hugging Face style" in note
    y = data[0][1][None]
    assert tokens.counter(loss)(y) == int((y[:, 1:] != -100).sum())
    # the same for the layers of a pipeline split (the command line builds those)
    stack = build_layers("tests.fixtures.hf_models:gpt2_shifted_uncounted_factory", 0)
    assert "shifts its labels" in check_loss_count(LossWeighting("tokens"), stack.model,
                                                    stack.dataset, stack.loss_fn)
    # declared, counted as given, or samples weighting: nothing to measure or say
    declared = hf_models.gpt2_shifted_factory()[2]
    assert check_loss_count(LossWeighting("tokens"), model, data, declared) is None
    assert check_loss_count(LossWeighting("tokens"), model, data, lm_loss) is None
    assert check_loss_count(LossWeighting("samples"), model, data, loss) is None

    def skips_two(out, t):
        return lm_loss(out[:, :-2], t[:, 2:])
    with pytest.raises(UsageError, match=r"the loss reads \d+ target positions .* "
                                         r"loss_fn.count_units = fn\(target\)"):
        check_loss_count(LossWeighting("tokens"), model, data, skips_two)
