"""The elementwise kernels (`scute.ops.elementwise`) against their PyTorch references, on strided inputs like the
column slices of a merged q/k/v or gate/up output. In Triton's interpreter on the CPU (float32; `tests/interpreter.py`,
with its fresh process when triton was imported first), on the GPU in float32 and bf16."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import DEVICE, interpreter_module, spy_launches, use_interpreter

FRESH_PROCESS = use_interpreter()  # before triton is imported (tests/interpreter.py)
pytest.importorskip("triton")

from scute.ops import elementwise as ew  # noqa: E402

DTYPES = [torch.float32] if DEVICE == "cpu" else [torch.float32, torch.bfloat16]


_in_interpreter_process, test_in_a_fresh_interpreter_process = interpreter_module(__file__, FRESH_PROCESS,
                                                                                  triton_cpu=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 64), (7, 96), (5, 4096)])
def test_rms_norm(monkeypatch, dtype, rows, cols):
    g = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols + 16, generator=g).to(DEVICE, dtype)[:, 8:8 + cols]  # a strided view
    w = (1 + 0.3 * torch.randn(cols, generator=g)).to(DEVICE, dtype)
    seen = spy_launches(monkeypatch, ew._kernels(), "rms_norm_kernel")
    got = ew.rms_norm(x, w, 1e-5)
    assert seen and got.dtype == dtype
    want = ew.rms_norm_ref(x, w, 1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def _delta(delta: str | None, shape, dtype, g) -> torch.Tensor | None:
    """A deferred delta (`scute.ops.elementwise.plus`) in the output's dtype or in float32, or none."""
    if delta is None:
        return None
    return (0.3 * torch.randn(shape, generator=g)).to(DEVICE, dtype if delta == "same" else torch.float32)


@pytest.mark.parametrize("delta", [None, "same", "float32"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 64), (5, 4096)])
def test_add_rms_norm(monkeypatch, dtype, rows, cols, delta):
    g = torch.Generator().manual_seed(rows + cols)
    x = torch.randn(rows, cols + 16, generator=g).to(DEVICE, dtype)[:, 8:8 + cols]  # a strided view
    residual = (4 * torch.randn(rows, cols, generator=g)).to(DEVICE, dtype)
    w = (1 + 0.3 * torch.randn(cols, generator=g)).to(DEVICE, dtype)
    dx = _delta(delta, (rows, cols), dtype, g)
    seen = spy_launches(monkeypatch, ew._kernels(), "add_rms_norm_kernel")
    got, total = ew.add_rms_norm(x, residual, w, 1e-5, dx)
    assert seen and got.dtype == total.dtype == dtype
    want, want_total = ew.add_rms_norm_ref(x, residual, w, 1e-5, dx)
    torch.testing.assert_close(total, want_total, rtol=0, atol=0)  # one rounding of the sum, as PyTorch's add
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(got, ew.rms_norm_ref(want_total, w, 1e-5), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 4, 2, 16), (9, 6, 2, 32), (3, 32, 8, 128)])
def test_rope_in_place_is_the_reference(monkeypatch, dtype, tokens, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(tokens * heads)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(DEVICE, dtype)  # a merged output
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    angle = torch.randn(tokens, dim, generator=g)
    cos, sin = angle.cos().to(DEVICE, dtype), angle.sin().to(DEVICE, dtype)
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    want_q, want_k = ew.rope_ref(q.clone(), k.clone(), cos, sin)
    seen = spy_launches(monkeypatch, ew._kernels(), "rope_kernel")
    got_q, got_k = ew.rope_(q, k, cos, sin)
    assert seen and got_q.data_ptr() == q.data_ptr()  # in place
    # every product and sum rounded where PyTorch rounds them; the GPU compiler may contract a product into the
    # sum (one rounding fewer): within one unit in the last place of the dtype
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(got_q, want_q, rtol=ulp, atol=ulp)
    torch.testing.assert_close(got_k, want_k, rtol=ulp, atol=ulp)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before)  # v untouched


@pytest.mark.parametrize("delta", [None, "same", "float32", "gate only"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 40), (6, 1500)])
def test_silu_mul(monkeypatch, dtype, rows, cols, delta):
    g = torch.Generator().manual_seed(cols)
    gate_up = (3 * torch.randn(rows, 2 * cols, generator=g)).to(DEVICE, dtype)
    gate, up = gate_up[:, :cols], gate_up[:, cols:]
    d_gate = _delta(None if delta is None else "same", (rows, cols), dtype, g)
    d_up = None if delta == "gate only" else _delta(delta, (rows, cols), dtype, g)
    seen = spy_launches(monkeypatch, ew._kernels(), "silu_mul_kernel")
    got = ew.silu_mul(gate, up, d_gate, d_up)
    assert seen
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, ew.silu_mul_ref(gate, up, d_gate, d_up), rtol=tol, atol=tol)
    if delta is not None:  # the delta counts: without it the result differs
        assert not torch.allclose(got, ew.silu_mul_ref(gate, up), rtol=tol, atol=tol)


@pytest.mark.parametrize("delta", ["same", "float32"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_add(monkeypatch, dtype, delta):
    """HF's second residual add with the down projection's deferred delta: each sum rounded as PyTorch's."""
    g = torch.Generator().manual_seed(3)
    residual, x = ((4 * torch.randn(1, 7, 300, generator=g)).to(DEVICE, dtype) for _ in range(2))
    dx = _delta(delta, (7, 300), dtype, g)
    seen = spy_launches(monkeypatch, ew._kernels(), "residual_add_kernel")
    got = ew.residual_add(residual, x, dx)
    assert seen and got.shape == x.shape
    assert torch.equal(got, residual + ew.plus(x, dx))
    assert not torch.equal(got, residual + x)
