"""glmlight/engines/local/packed.py: a linear layer through oneDNN with its weight reordered once gives
F.linear's values (float reassociation only), with or without a bias and over any leading shape; a row's
result does not depend on the other rows of the call; what cannot be packed falls back to F.linear."""

import pytest
import torch
import torch.nn.functional as F

from glmlight.engines.local import packed


def test_packed_linear_is_f_linear():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 40, generator=g) * 0.2, torch.randn(48, generator=g)
    p = packed.pack(w)
    if p is None:
        pytest.skip("torch was built without oneDNN")
    for x in (torch.randn(1, 40, generator=g), torch.randn(7, 40, generator=g), torch.randn(3, 5, 40, generator=g)):
        for bias in (None, b):
            got = packed.linear(x, None, bias, p)
            assert got.shape == x.shape[:-1] + (48,)
            torch.testing.assert_close(got, F.linear(x, w, bias), atol=1e-5, rtol=1e-5)


def test_a_rows_result_does_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(96, 64, generator=g), torch.randn(32, 64, generator=g)
    p = packed.pack(w)
    if p is None:
        pytest.skip("torch was built without oneDNN")
    whole = packed.linear(x, None, None, p)
    for n in (1, 5, 17):
        assert torch.equal(packed.linear(x[:n], None, None, p), whole[:n])


def test_what_cannot_be_packed_stays_f_linear():
    w = torch.randn(8, 4)
    assert packed.pack(w.bfloat16()) is None and packed.pack(torch.randn(2, 8, 4)) is None
    x = torch.randn(3, 4)
    assert torch.equal(packed.linear(x, w, None, None), F.linear(x, w))
