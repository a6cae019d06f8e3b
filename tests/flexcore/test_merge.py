"""flexcore.kernels.merge: attention over disjoint key sets merged by lse, against float64."""
from __future__ import annotations

import pytest
import torch

from flexcore.errors import InputError
from flexcore.kernels.merge import merge


def _parts(n, dtype, seed, shape=(2, 3, 37, 40), device="cpu"):
    g = torch.Generator().manual_seed(seed)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    parts = []
    for i in range(n):
        out = torch.randn(shape, generator=g).to(dtype)
        lse = torch.randn(shape[:3], generator=g, dtype=lse_dtype) * 3
        lse[0, 0, :5] = -torch.inf       # rows no part attends to
        if i == 0:
            lse[1, 1, 3] = -torch.inf    # a row only the other parts attend to
        parts.append((out.to(device).requires_grad_(True), lse.to(device).requires_grad_(True)))
    return parts


def _reference(parts):
    """The merge in float64 from its definition."""
    lses = torch.stack([lse.double() for _, lse in parts])
    lse = torch.logsumexp(lses, 0)
    kept = torch.isfinite(lse)
    out = sum(torch.where(kept, torch.exp(l.double() - torch.where(kept, lse, 0.0)), 0.0).unsqueeze(-1)
              * o.double() for o, l in parts)
    return out, lse


def _finite(x):
    return x.masked_fill(torch.isinf(x), 0.0)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("lse_grad", [True, False])
def test_merge_matches_float64(n, dtype, lse_grad):
    _check_merge(n, dtype, lse_grad, "cpu", (2, 3, 37, 40))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_merge_matches_float64_gpu(dtype, head_dim):
    _check_merge(2, dtype, True, "cuda", (2, 4, 1000, head_dim))


def _check_merge(n, dtype, lse_grad, device, shape):
    parts = _parts(n, dtype, seed=n * 10 + lse_grad, shape=shape, device=device)
    out, lse = merge(parts, dtype)
    assert out.dtype == dtype and lse.dtype == parts[0][1].dtype
    out, lse = out.cpu(), lse.cpu()  # compared on the host with the float64 reference
    doubles = [(o.detach().cpu().double().requires_grad_(True),
                l.detach().cpu().double().requires_grad_(True)) for o, l in parts]
    ref_out, ref_lse = _reference(doubles)
    # One rounding to the output dtype (the merge accumulates in float32, float64 for float64).
    eps = torch.finfo(dtype).eps
    scale = ref_out.abs().max().item()
    assert (out.double() - ref_out).abs().max().item() <= 2 * eps * scale + 1e-6
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert (_finite(lse).double() - _finite(ref_lse)).abs().max().item() <= 1e-5
    assert bool((out[0, 0, :5] == 0).all())

    g = torch.Generator().manual_seed(7)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grad_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    loss = (out.double() * grad_out).sum()
    ref_loss = (ref_out * grad_out).sum()
    if lse_grad:
        loss = loss + (_finite(lse).double() * grad_lse).sum()
        ref_loss = ref_loss + (_finite(ref_lse) * grad_lse).sum()
    loss.backward()
    ref_loss.backward()
    grads = [(o.grad.cpu(), l.grad.cpu()) for o, l in parts]
    for (go, gl), (ro, rl) in zip(grads, doubles):
        assert torch.isfinite(go).all() and torch.isfinite(gl).all()
        assert (go.double() - ro.grad).abs().max().item() <= 4 * eps * grad_out.abs().max().item() + 1e-6
    # The lse's gradient reads the output's gradient as it reaches a tensor of the output dtype,
    # rounded there (as in torch): its error is bounded per row by eps * w_i * sum_d |dO| |O_i|.
    w = [torch.exp(_finite(rl.detach()) - _finite(ref_lse.detach())) * torch.isfinite(ref_lse)
         for _, rl in doubles]
    spread = sum(wi * (grad_out.abs() * ro.detach().abs()).sum(-1) for wi, (ro, _) in zip(w, doubles))
    for (_, gl), (ro, rl), wi in zip(grads, doubles, w):
        defined = torch.isfinite(rl.grad)  # the float64 formula has none where every lse is -inf
        bound = 2 * eps * wi * spread + 1e-5 * (1 + rl.grad.abs())
        assert bool(((gl.double() - rl.grad).abs() <= bound)[defined].all())
        assert bool((gl[~defined] == 0).all()) and bool((~defined[0, 0, :5]).all())


def test_merge_of_one_part_is_that_part():
    (out, lse), = _parts(1, torch.float32, seed=3)
    merged = merge([(out, lse)], torch.float32)
    assert merged[0] is out and merged[1] is lse


def test_merge_of_transposed_parts_with_a_loss_on_the_lse_alone():
    """Parts that are views with other strides, and a gradient that reaches the lse only (the
    outputs' gradient is then zero), against float64."""
    g = torch.Generator().manual_seed(11)
    parts = []
    for _ in range(2):
        out = torch.randn(2, 5, 3, 24, generator=g).transpose(1, 2).requires_grad_(True)  # (2, 3, 5, 24)
        lse = (torch.randn(2, 5, 3, generator=g) * 2).transpose(1, 2).requires_grad_(True)
        parts.append((out, lse))
    merged_out, merged_lse = merge(parts, torch.float32)
    doubles = [(o.detach().double().requires_grad_(True), l.detach().double().requires_grad_(True))
               for o, l in parts]
    ref_out, ref_lse = _reference(doubles)
    torch.testing.assert_close(merged_out.double(), ref_out, atol=1e-6, rtol=1e-6)
    merged_lse.sum().backward()
    ref_lse.sum().backward()
    for (o, l), (ro, rl) in zip(parts, doubles):
        assert bool((o.grad == 0).all())
        torch.testing.assert_close(l.grad.double(), rl.grad, atol=1e-6, rtol=1e-6)


def test_merge_refuses_a_second_derivative():
    parts = _parts(2, torch.float64, seed=5)
    out, _ = merge(parts, torch.float64)
    weights = torch.ones_like(out, requires_grad=True)  # a gradient the second derivative reads
    (grad,) = torch.autograd.grad(out, parts[0][0], grad_outputs=weights, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()


@pytest.mark.parametrize("bad, match", [
    (lambda p: [p[0], (p[1][0][..., :-1], p[1][1])], r"parts\[1\] has out \(2, 3, 37, 39\)"),
    (lambda p: [p[0], (p[1][0], p[1][1][..., :-1])], r"parts\[1\] has out .* and lse \(2, 3, 36\)"),
    (lambda p: [p[0], (p[1][0], p[1][1].half())], r"parts\[1\]'s lse has dtype torch.float16"),
    (lambda p: [p[0], p[1][0]], r"parts\[1\] is not an \(out, lse\) pair"),
    (lambda p: [], "parts is empty"),
])
def test_merge_refuses_parts_it_cannot_read_as_rows(bad, match):
    parts = [(o.detach(), l.detach()) for o, l in _parts(2, torch.float32, seed=9)]
    with pytest.raises(InputError, match=match):
        merge(bad(parts), torch.float32)
