"""The gpt-oss expert reference (CPU): its activation and its layer against
the model's formula written out token by token in float64, on MXFP4
weights through flashgemm.mxfp4."""

import torch

from flashgemm.moe.gpt_oss import clamped_swiglu, gpt_oss_experts_ref
from flashgemm.mxfp4 import dequantize_mxfp4, quantize_mxfp4


def _act(g: float, u: float) -> float:
    """gpt-oss's activation of one (gate, up) pair, as its model code states it."""
    import math

    g = min(g, 7.0)
    u = max(-7.0, min(7.0, u))
    return g / (1.0 + math.exp(-1.702 * g)) * (u + 1.0)


def test_activation_clamps_and_interleaves():
    gu = torch.tensor([[9.0, 0.5, -3.0, 12.0, 1.0, -9.0, 0.0, 0.0]], dtype=torch.float64)
    got = clamped_swiglu(gu)
    want = torch.tensor([[_act(9.0, 0.5), _act(-3.0, 12.0), _act(1.0, -9.0), _act(0.0, 0.0)]], dtype=torch.float64)
    # the same few float64 operations in another order: a few ulps of values below 10
    assert torch.allclose(got, want, rtol=1e-14, atol=1e-14)
    assert got[0, 0] == clamped_swiglu(torch.tensor([[7.0, 0.5]], dtype=torch.float64))[0, 0]  # gate capped at 7
    assert clamped_swiglu(torch.ones(1, 2)).dtype == torch.float32


def test_layer_matches_the_formula_token_by_token():
    g = torch.Generator().manual_seed(3)
    e, max_m, hidden, inter, tokens = 3, 5, 64, 32, 6
    w13 = dequantize_mxfp4(*quantize_mxfp4(torch.randn(e, 2 * inter, hidden, generator=g) / 8))
    w2 = dequantize_mxfp4(*quantize_mxfp4(torch.randn(e, hidden, inter, generator=g) / 8))
    b13, b2 = torch.randn(e, 2 * inter, generator=g), torch.randn(e, hidden, generator=g)
    x = torch.randn(e, max_m, hidden, generator=g)
    masked_m = torch.tensor([5, 0, 3], dtype=torch.int32)
    token_index = torch.randint(0, tokens, (e, max_m), generator=g, dtype=torch.int32)
    weight = torch.rand(e, max_m, generator=g)
    got = gpt_oss_experts_ref(x, masked_m, w13, b13, w2, b2, token_index=token_index, weight=weight,
                              num_tokens=tokens)
    want = torch.zeros(tokens, hidden, dtype=torch.float64)
    bound = torch.zeros(tokens, hidden, dtype=torch.float64)  # how far two float64 summation orders may differ
    u = 2.0 ** -53
    for ex in range(e):
        w13d, w2d = w13[ex].double(), w2[ex].double()
        for r in range(int(masked_m[ex])):
            xr = x[ex, r].double()
            gu = w13d @ xr + b13[ex].double()
            gu_err = (hidden + 2) * u * (w13d.abs() @ xr.abs() + b13[ex].double().abs())
            h = torch.tensor([_act(float(gu[2 * j]), float(gu[2 * j + 1])) for j in range(inter)],
                             dtype=torch.float64)
            y = w2d @ h + b2[ex].double()
            # the activation's slope is below 20 where |gate|, |up| <= 7 (and 0 beyond the clamps), plus
            # its own few roundings
            h_err = 20 * gu_err.max() + 8 * u * h.abs()
            y_err = (inter + 2) * u * (w2d.abs() @ h.abs() + b2[ex].double().abs()) + w2d.abs() @ h_err
            t = int(token_index[ex, r])
            want[t] += float(weight[ex, r]) * y
            bound[t] += float(weight[ex, r]) * y_err + 2 * u * (want[t].abs() + y.abs())
    assert got.dtype == torch.float64 and ((got - want).abs() <= bound).all()
    rows = gpt_oss_experts_ref(x, masked_m, w13, b13, w2, b2)
    assert (rows[1] == 0).all() and (rows[2, 3:] == 0).all()  # rows >= m_e stay zero
