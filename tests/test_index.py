import numpy as np
import pytest
import torch

from kvmem._index import as_index_array


def test_a_cpu_int64_tensor_is_viewed_without_a_copy():
    t = torch.arange(5)
    arr = as_index_array("slots", t)
    assert arr.dtype == np.int64 and arr.tolist() == [0, 1, 2, 3, 4]
    t[0] = 7
    assert arr[0] == 7


@pytest.mark.parametrize("value", [torch.arange(4, dtype=torch.int32), np.arange(4, dtype=np.uint8), [0, 1, 2, 3],
                                   torch.arange(8)[::2] // 2])
def test_other_integer_inputs_become_int64(value):
    assert as_index_array("slots", value).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("value, error, words", [
    (torch.zeros(2, 2, dtype=torch.int64), ValueError, "slots must be 1-D"),
    (torch.ones(3, dtype=torch.bool), TypeError, "must hold integers"),
    (torch.ones(3), TypeError, "must hold integers"),
    (torch.empty(3, dtype=torch.int64, device="meta"), ValueError, "'meta' device"),
    (torch.nn.Parameter(torch.ones(3), requires_grad=False), TypeError, "must hold integers"),
    (np.ones((2, 2), dtype=np.int64), ValueError, "slots must be 1-D"),
    (b"\x01\x02", TypeError, "must hold integers"),
    ([0.5], TypeError, "must hold integers"),
])
def test_bad_inputs_are_named(value, error, words):
    with pytest.raises(error, match=words):
        as_index_array("slots", value)
