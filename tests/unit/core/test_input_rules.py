"""The input rules in one wording: the eager model, every runtime and the server's checks give
the same rule text for the same broken input."""

import numpy as np
import pytest
import torch

from vqserve.core import input_rules
from vqserve.export.runtimes.synthetic import SyntheticRuntime
from vqserve.model.quantizers.common import check_indices as check_index_tensor

SIZE = "H and W must be positive multiples of the downsampling factor 8, got 20x16"
RANGE = "every index must lie in [0, 999] (codebook size 1000), got values in [1000, 1000]"


def test_an_image_size_reads_the_same_to_the_model_the_runtimes_and_the_server():
    assert input_rules.image_size_rule(20, 16, 8, 1 << 20) == SIZE
    with pytest.raises(ValueError) as runtime:
        input_rules.check_images(np.zeros((1, 20, 16, 3), np.uint8), 8)
    assert str(runtime.value) == f"images: {SIZE}"


def test_an_index_range_reads_the_same_everywhere():
    indices = np.full((1, 2, 2), 1000, np.int64)
    assert input_rules.index_range_rule(indices, 1000) == RANGE
    with pytest.raises(ValueError) as runtime:
        input_rules.check_indices(indices, 1000)
    assert str(runtime.value) == f"indices: {RANGE}"
    with pytest.raises(ValueError) as model:
        check_index_tensor(torch.from_numpy(indices), 1000, "FSQ")
    assert str(model.value) == f"FSQ: {RANGE}"


def test_the_stand_in_runtime_says_it_the_same_way():
    with pytest.raises(ValueError, match=r"indices: every index must lie in \[0, 63999\] \(codebook size 64000\)"):
        SyntheticRuntime("synthetic:0").decode(np.full((1, 2, 2), 64000, np.int64))
