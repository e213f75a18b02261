"""Shape inference through torch's C++ meta functions (csrc/capture/meta_functions.h): for each
op the table covers, the placeholder an op returns in placeholder mode has the sizes, strides,
storage offset and dtype of the tensor eager returns, on contiguous and on transposed, sliced and
channels-last inputs, and the shape cache's miss ran the C++ function, not the dispatcher's meta
kernel (which torch writes in Python for these ops)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from terra_torch import _C, debug

g = torch.Generator().manual_seed(0)


def r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def t_(x: torch.Tensor) -> torch.Tensor:
    """A transposed (non-contiguous) view."""
    return x.t()


def cl(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last)


labels = torch.randint(0, 5, (6,), generator=g)
index = torch.randint(0, 4, (3, 5), generator=g)

# name -> (function, arguments); each runs once eagerly and once in placeholder mode.
CASES: dict[str, tuple[Callable[..., Any], tuple]] = {
    "addmm": (lambda b, a, w: torch.addmm(b, a, w.t()), (r(7), r(6, 5), r(7, 5))),
    "addmm_transposed": (lambda b, a, w: torch.addmm(b, a, w), (r(6, 7), t_(r(5, 6)), r(5, 7))),
    "mm": (torch.mm, (t_(r(5, 6)), r(5, 3))),
    "bmm": (torch.bmm, (r(2, 3, 4), r(2, 4, 5).transpose(1, 2).contiguous().transpose(1, 2))),
    "baddbmm": (lambda s, a, b: torch.baddbmm(s, a, b, beta=0.5), (r(2, 3, 5), r(2, 3, 4), r(2, 4, 5))),
    "add_broadcast_transposed": (lambda a, b: a + b * 2, (t_(r(5, 6)), r(5))),
    "sub_scalar_tensor": (lambda a: a - 3, (r(4, 3)[:, 1:],)),
    "mul_int_by_float": (lambda a: a * 0.5, (torch.arange(12).view(3, 4),)),
    "div_mode": (lambda a, b: torch.div(a, b, rounding_mode="floor"), (r(3, 4), r(4))),
    "inplace_add_mul_div": (lambda a, b: a.clone().add_(b, alpha=0.1).mul_(b).div_(b), (r(3, 4), r(3, 4))),
    "unary": (lambda a: [f(a) for f in (torch.neg, torch.exp, torch.log1p, torch.sqrt, torch.rsqrt, torch.tanh,
                                        torch.sigmoid, torch.sin, torch.cos, torch.reciprocal, torch.sign,
                                        torch.erf, torch.floor, torch.ceil, torch.trunc, torch.exp2,
                                        torch.log2, torch.expm1)], (t_(r(4, 3).abs() + 0.1),)),
    "unary_inplace": (lambda a: a.clone().neg_().exp_().sqrt_().tanh_().sigmoid_().rsqrt_().reciprocal_(),
                      (r(4, 3),)),
    "activations": (lambda a: [torch.relu(a), F.threshold(a, 0.1, 0.0), F.gelu(a), F.gelu(a, approximate="tanh"),
                               F.silu(a), F.leaky_relu(a, 0.2), F.elu(a), F.softplus(a), F.hardsigmoid(a),
                               F.mish(a)], (t_(r(5, 4)),)),
    "activation_backward": (lambda a, g_: [torch.ops.aten.threshold_backward(g_, a, 0.0),
                                           torch.ops.aten.tanh_backward(g_, a),
                                           torch.ops.aten.sigmoid_backward(g_, a),
                                           torch.ops.aten.gelu_backward(g_, a),
                                           torch.ops.aten.leaky_relu_backward(g_, a, 0.2, False),
                                           torch.ops.aten.softplus_backward(g_, a, 1.0, 20.0)],
                            (r(4, 5), t_(r(5, 4)))),
    "softmax_family": (lambda a: [F.log_softmax(a, 1), F.softmax(a, 0),
                                  torch.ops.aten._log_softmax_backward_data(a, a, 1, torch.float32),
                                  torch.ops.aten._softmax_backward_data(a, a, 0, torch.float32)], (t_(r(5, 6)),)),
    "losses": (lambda x, y, z: [F.cross_entropy(x, labels), F.nll_loss(x, labels, reduction="none"),
                                F.mse_loss(y, z), F.smooth_l1_loss(y, z, reduction="none")],
               (r(6, 5), r(6, 3), t_(r(3, 6)))),
    "nll_loss_backward": (lambda x, gr: torch.ops.aten.nll_loss_backward(gr, x, labels, None, 1, -100, torch.tensor(6.0)),
                          (r(6, 5), torch.tensor(1.0))),
    "reductions": (lambda a: [a.mean(1), a.sum(0, keepdim=True), a.amax(1), a.amin(0), a.argmax(1), a.argmin(),
                              a.max(1), a.min(0), a.cumsum(1), a.cumprod(0), a.norm(2, 1),
                              torch.linalg.vector_norm(a, 2, (0,)), (a > 0).all(1), (a > 0).any(0), a.prod(1),
                              a.sum(1, dtype=torch.float64)], (t_(r(5, 4)),)),
    "comparisons": (lambda a, b: [a == 0, a != b, a < 0.5, a <= b, a > b, a >= 1], (t_(r(4, 3)), r(4))),
    "clamps": (lambda a, lo: [a.clamp(-0.5, 0.5), a.clamp(min=lo), a.clamp_min(0.1), a.clamp_max(0.2),
                              a.clone().clamp_(-1, 1), a.clone().clamp_min_(0), a.clone().clamp_max_(0)],
               (t_(r(4, 3)), r(4))),
    "binary": (lambda a, b: [a.pow(2), a.abs().pow(b), torch.pow(2.0, a), torch.maximum(a, b), torch.minimum(a, b),
                             torch.atan2(a, b), torch.lerp(a, b, 0.3), torch.lerp(a, b, b.sigmoid()),
                             a.clone().lerp_(b, 0.5), a.clone().pow_(2.0), torch.addcmul(a, a, b, value=0.5),
                             torch.addcdiv(a, a, b.abs() + 1), a.clone().addcmul_(a, b), a.clone().addcdiv_(a, b.abs() + 1)],
               (t_(r(4, 3)), r(4))),
    "indexing": (lambda a, b: [torch.cat([a, b], 0), torch.cat([a.t(), b.t()], 1), torch.gather(a, 1, index[:, :3]),
                               a.scatter(1, index[:, :3], b[:3, :3]), a.scatter(1, index[:, :3], 1.5),
                               a.scatter_add(1, index[:, :3], b[:3, :3]), a.index_add(0, torch.tensor([0, 2]), b[:2]),
                               a.topk(2, 1), a.sort(stable=True, dim=1), a[torch.tensor([2, 0])],
                               a[:, torch.tensor([1, 0])]],
                 (r(3, 4), r(3, 4))),
    "like_and_zero": (lambda a: [torch.ones_like(a), torch.zeros_like(a, dtype=torch.float64), torch.empty_like(a),
                                 torch.ones_like(a, memory_format=torch.contiguous_format), a.clone().zero_()],
                      (t_(r(4, 3)),)),
    "like_channels_last": (lambda x: [torch.ones_like(x), torch.zeros_like(x[:, :, 1:])], (cl(r(2, 3, 4, 4)),)),
    "scalar_overloads": (lambda a, i: [torch.ops.aten.add.Scalar(a, 2.0, alpha=3), torch.ops.aten.sub.Scalar(i, 2),
                                       torch.ops.aten.mul.Scalar(i, 0.5), torch.ops.aten.div.Scalar(i, 3),
                                       torch.ops.aten.mul.Scalar(a, 2), torch.ops.aten.add_.Scalar(a.clone(), 1.5),
                                       torch.ops.aten.sub_.Scalar(a.clone(), 1), torch.ops.aten.mul_.Scalar(a.clone(), 0.5),
                                       torch.ops.aten.div_.Scalar(a.clone(), 4)],
                         (t_(r(4, 3)), torch.arange(12).view(3, 4).t())),
    "unsafe_view": (lambda a: [torch.ops.aten._unsafe_view(a, [6, 2]), torch.ops.aten._unsafe_view(a[1:], [8])],
                    (r(3, 4),)),
    "pooling": (lambda x: [F.max_pool2d(x, 2), F.max_pool2d(x, 3, 2, 1, return_indices=True), F.avg_pool2d(x, 2),
                           F.interpolate(x, scale_factor=2, mode="nearest"),
                           F.interpolate(x, size=(5, 7), mode="bilinear", align_corners=False),
                           F.adaptive_max_pool2d(x, 3)], (cl(r(2, 3, 6, 6)),)),
    # torch.distributions' samplers without a meta kernel of torch's (random: only metadata compared)
    "distribution_samplers": (lambda a, c: [torch._sample_dirichlet(a), torch.binomial(c, c / 20),
                                            torch._standard_gamma_grad(a, a), torch._dirichlet_grad(a, a, a)],
                              (t_(r(4, 3).abs() + 0.5), torch.full((3, 4), 10.0).t())),
}


def tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in tensors(o)]
    return []


@pytest.mark.parametrize("case", sorted(CASES))
def test_placeholder_metadata_from_cpp_meta_functions_is_eagers(case: str):
    fn, args = CASES[case]
    eager = tensors(fn(*args))
    before = _C.shape_cache_counts()
    out, trace = debug.record(fn, *args, mode="placeholder")
    after = _C.shape_cache_counts()
    placeholders = tensors(out)
    assert len(placeholders) == len(eager)
    for k, (e, p) in enumerate(zip(eager, placeholders)):
        assert _C.is_placeholder(p), (case, k)
        got = (tuple(p.shape), p.stride(), p.storage_offset(), p.dtype)
        want = (tuple(e.shape), e.stride(), e.storage_offset(), e.dtype)
        assert got == want, (case, k, trace.names)
    # Every new cache entry of an op the table covers ran the C++ function. (The ops it does not
    # cover here, views and clone, have C++ meta kernels in the dispatcher.)
    assert after["cpp_meta"] > before["cpp_meta"], (case, trace.names)


def test_the_table_names_real_ops():
    """Every entry names an op torch has, in the form the lookup builds from an OperatorHandle
    (an entry that matched no op would silently never be used), and the common training ops are
    among them."""
    names = _C.shape_cache_counts()["cpp_meta_ops"]
    assert len(names) >= 140
    for full in names:
        name, _, overload = full.rpartition(".")
        torch._C._get_schema(name, overload)  # raises for an unknown op or overload
    for common in ("aten::addmm.", "aten::mul.Tensor", "aten::relu.", "aten::_log_softmax.",
                   "aten::nll_loss_forward.", "aten::threshold_backward.", "aten::add_.Tensor", "aten::addcdiv_."):
        assert common in names
