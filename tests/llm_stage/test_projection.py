"""`project`: the backbone's linear layers, weight-major for decode-sized inputs on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llm_stage.models.llama import DECODE_ROWS, project


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (4, 1), (DECODE_ROWS, 1), (DECODE_ROWS + 1, 1), (3, 5)])
def test_project_matches_linear(shape, with_bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, 32, generator=gen)
    weight = torch.randn(48, 32, generator=gen)
    bias = torch.randn(48, generator=gen) if with_bias else None
    out = project(x, weight, bias)
    assert out.shape == (*shape, 48) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_project_keeps_linear_for_half_precision():
    x = torch.randn(4, 1, 32).to(torch.bfloat16)
    weight = torch.randn(48, 32).to(torch.bfloat16)
    assert torch.equal(project(x, weight), F.linear(x, weight))
