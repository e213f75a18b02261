"""The capture layer against eager PyTorch as the oracle.

Recording mode must see exactly the ops a TorchDispatchMode sees (factories, RNG, backward and
optimizer ops included), leave results bitwise equal to eager, and give locations that are
stable across iterations and distinct across call sites. Placeholder mode must reproduce every
output's metadata without computing anything.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import terra_torch
from terra_torch import _C, debug

from capture_programs import batch, forward_backward, make_cnn, make_mlp, train_step

MAKERS = {"mlp": make_mlp, "cnn": make_cnn}


class NameLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())  # "aten::addmm", "aten::add.Tensor"
        return func(*args, **(kwargs or {}))


def dispatch_mode_names(kind: str, steps: int) -> list[list[str]]:
    model, opt = MAKERS[kind]()
    out = []
    for step in range(steps):
        x, y = batch(kind, step)
        torch.manual_seed(step)
        with NameLog() as log:
            train_step(model, opt, x, y)
        out.append(log.names)
    return out


def assert_same_ops(recorded: list[str], observed: list[str]) -> int:
    """recorded == observed, except for the aten::detach a TorchDispatchMode adds itself and the
    profiler's record_function ops.

    With a mode active, autograd saves each output it keeps for backward through an extra
    aten::detach (observed on torch 2.13: one after relu, _log_softmax, nll_loss_backward...);
    plain eager runs no such op, so the capture layer rightly does not record it. The profiler
    ops torch.optim runs around step() and zero_grad() neither take nor give tensors: the capture
    layer runs them and records nothing (capture/region.cpp, Region::handle). Every other op must
    match one for one, in order. Returns how many profiler ops the mode saw.
    """
    i = 0
    skipped = 0
    profiler = 0
    for name in observed:
        if i < len(recorded) and recorded[i] == name:
            i += 1
        elif name == "aten::detach":
            skipped += 1
        elif name.startswith("profiler::_record_function"):
            profiler += 1
        else:
            raise AssertionError(f"op {i}: recorded {recorded[i:i + 3]} but the dispatch mode saw {name}")
    assert i == len(recorded), f"recorded extra ops: {recorded[i:]}"
    assert skipped <= len(observed) // 4  # the exemption stays an exemption
    return profiler


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_recorded_ops_equal_dispatch_mode_ops(kind):
    expected = dispatch_mode_names(kind, 2)
    model, opt = MAKERS[kind]()
    for step in range(2):
        x, y = batch(kind, step)
        torch.manual_seed(step)
        _, trace = debug.record(train_step, model, opt, x, y)
        profiler_ops = assert_same_ops(trace.names, expected[step])
        assert profiler_ops == 4, profiler_ops  # enter and exit around zero_grad() and step()
        assert any(op.backward for op in trace.ops), "backward ops must be captured"
    names = set(trace.names)
    if kind == "cnn":
        assert "aten::bernoulli_.float" in names or "aten::native_dropout" in names  # RNG captured
        assert any(n.startswith("aten::convolution_backward") for n in names)
    else:
        assert "aten::_local_scalar_dense" in names  # Adam reads its step counter on CPU


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_recorded_run_is_bitwise_eager(kind):
    eager_model, eager_opt = MAKERS[kind]()
    rec_model, rec_opt = MAKERS[kind]()
    for step in range(3):
        x, y = batch(kind, step)
        torch.manual_seed(step)
        eager_loss = train_step(eager_model, eager_opt, x, y)
        torch.manual_seed(step)
        rec_loss, _ = debug.record(train_step, rec_model, rec_opt, x, y)
        assert torch.equal(eager_loss, rec_loss)
    for (name, a), (_, b) in zip(eager_model.state_dict().items(), rec_model.state_dict().items()):
        assert torch.equal(a, b), name
    for pa, pb in zip(eager_model.parameters(), rec_model.parameters()):
        sa, sb = eager_opt.state[pa], rec_opt.state[pb]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), key


def test_factories_and_rng_are_seen_and_reproducible():
    def fn():
        a = torch.zeros(3) + torch.ones(3)
        b = torch.randn(3) * torch.rand(3)
        c = torch.arange(3) + torch.randint(0, 5, (3,))
        return a, b, c, torch.full((2,), 7.0), torch.tensor([1.0, 2.0])

    torch.manual_seed(5)
    eager = fn()
    torch.manual_seed(5)
    recorded, trace = debug.record(fn)
    for e, r in zip(eager, recorded):
        assert torch.equal(e, r)
    with NameLog() as log:
        torch.manual_seed(5)
        fn()
    assert_same_ops(trace.names, log.names)
    for factory in ["aten::zeros", "aten::ones", "aten::randn", "aten::rand", "aten::arange",
                    "aten::randint.low", "aten::full", "aten::lift_fresh"]:
        assert factory in trace.names, factory


def test_value_references_follow_dataflow():
    w = torch.randn(4, 4)

    def fn(x):
        y = x @ w
        y.add_(1)
        return y.relu()

    _, trace = debug.record(fn, torch.randn(2, 4))
    mm, add_, relu = trace.ops
    assert mm.name == "aten::mm"
    assert {i.external for i in mm.inputs} == {0, 1}
    assert add_.inputs[0].op == 0 and add_.inputs[0].output == 0
    # After the in-place add the newest version of y is add_'s output.
    assert relu.inputs[0].op == 1
    assert relu.attributes == ()
    assert add_.attributes == (1,)
    assert trace.externals[1][0].shape == (4, 4)


def test_locations_stable_across_iterations_and_distinct_across_call_sites():
    model, opt = make_mlp()

    def loop():
        for step in range(3):
            x, y = batch("mlp", step)
            train_step(model, opt, x, y)

    _, trace = debug.record(loop)
    # The outermost loop frame numbers the training loop's iterations.
    by_iteration: dict[int, list] = {}
    for op in trace.ops:
        assert op.loops, op.name
        by_iteration.setdefault(op.loops[0][1], []).append(op)
    assert sorted(by_iteration) == [0, 1, 2]
    assert len({op.loops[0][0] for op in trace.ops}) == 1
    # Iteration 0 creates Adam's state lazily; iterations 1 and 2 are the steady state.
    second, third = by_iteration[1], by_iteration[2]
    assert [o.name for o in second] == [o.name for o in third]
    assert [o.location for o in second] == [o.location for o in third]
    # Adam's step passes other Python floats each iteration: they are values, not identity
    # (hashed by type only; co-execution feeds them), so the ops still key alike.
    assert [o.attributes_hash for o in second] == [o.attributes_hash for o in third]
    step_sizes = [[o.attributes for o in ops if o.name == "aten::addcdiv_"] for ops in (second, third)]
    assert step_sizes[0] and step_sizes[0] != step_sizes[1]

    layer = torch.nn.Linear(4, 4)

    def two_sites(x):
        a = layer(x)  # site 1
        b = layer(x)  # site 2
        return a, b

    _, trace = debug.record(two_sites, torch.randn(2, 4))
    addmms = [op for op in trace.ops if op.name == "aten::addmm"]
    assert len(addmms) == 2 and addmms[0].location != addmms[1].location
    assert "two_sites" in str(addmms[0].location)
    # Backward ops are anchored to the forward op that created their node.
    x = torch.randn(2, 4, requires_grad=True)
    _, trace = debug.record(lambda: two_sites(x)[0].sum().backward())
    assert any(op.backward for op in trace.ops)


def test_inner_python_loop_iterations_share_locations():
    def fn(x):
        for _ in range(3):
            x = torch.tanh(x) * 2
        return x

    _, trace = debug.record(fn, torch.randn(3))
    tanh = [op for op in trace.ops if op.name == "aten::tanh"]
    assert len({op.location for op in tanh}) == 1
    assert [op.loops[-1][1] for op in tanh] == [0, 1, 2]
    assert len({op.loops[-1][0] for op in tanh}) == 1


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_placeholder_metadata_equals_eager(kind):
    # Forward + backward for both; the full step (SGD with momentum) for the CNN.
    step_fn = train_step if kind == "cnn" else forward_backward
    eager_model, eager_opt = MAKERS[kind]()
    ph_model, ph_opt = MAKERS[kind]()
    x, y = batch(kind, 0)
    args = (eager_model, eager_opt, x, y) if step_fn is train_step else (eager_model, x, y)
    torch.manual_seed(0)
    _, recorded = debug.record(step_fn, *args)
    args = (ph_model, ph_opt, x, y) if step_fn is train_step else (ph_model, x, y)
    torch.manual_seed(0)
    loss, placeholder = debug.record(step_fn, *args, mode="placeholder")
    assert _C.is_placeholder(loss)
    assert placeholder.names == recorded.names
    for r, p in zip(recorded.ops, placeholder.ops):
        assert [(m.dtype, m.shape, m.stride, m.storage_offset, m.device) for m in p.outputs] == [
            (m.dtype, m.shape, m.stride, m.storage_offset, m.device) for m in r.outputs
        ], r.name
    assert loss.shape == () and loss.requires_grad and loss.grad_fn is not None
    grads = [p.grad for p in ph_model.parameters()]
    assert all(g is not None and g.shape == p.shape for g, p in zip(grads, ph_model.parameters()))


def test_placeholder_data_access_names_the_producer():
    def fn(x):
        return (x * 2).numpy()

    with pytest.raises(Exception, match="aten::mul"):
        debug.record(fn, torch.randn(3), mode="placeholder")


def test_placeholder_mode_flags_values_it_cannot_invent():
    def fn(x):
        return torch.nonzero(x > 0)

    with pytest.raises(RuntimeError, match="aten::nonzero"):
        debug.record(fn, torch.randn(5), mode="placeholder")

    def reads(x):
        return (x + 1).sum().item()

    with pytest.raises(RuntimeError, match="_local_scalar_dense"):
        debug.record(reads, torch.randn(5), mode="placeholder")


def test_placeholder_views_alias_their_base():
    def fn(x):
        y = x * 2
        v = y[1:]
        v.add_(1)
        return y, v

    (y, v), trace = debug.record(fn, torch.randn(4, 3), mode="placeholder")
    assert v.storage_offset() == 3 and v.shape == (3, 3) and v.stride() == (3, 1)
    assert v._base is y  # autograd's view tracking sees a real view
    with pytest.raises(RuntimeError, match="placeholder produced by aten::mul"):
        v.untyped_storage()
    names = trace.names
    assert names == ["aten::mul.Tensor", "aten::slice.Tensor", "aten::add_.Tensor"]


def test_regions_do_not_nest_and_bad_mode_is_rejected():
    with pytest.raises(RuntimeError, match="capture mode must be"):
        _C.Region("fast")

    def inner():
        return debug.record(lambda: torch.ones(1))

    with pytest.raises(RuntimeError, match="do not nest"):
        debug.record(inner)
    # The failed inner attempt left the outer region consistent: recording still works.
    _, trace = debug.record(lambda: torch.ones(2) * 3)
    assert trace.names == ["aten::ones", "aten::mul.Tensor"]


def test_no_interception_outside_regions():
    x = torch.randn(3)
    y = (x * 2).sum()
    assert not _C.is_placeholder(y)
    assert y.item() == (x * 2).sum().item()


def test_shape_cache_makes_repeated_ops_a_lookup():
    def fn(x):
        return torch.sigmoid(x * 3).cumsum(0)

    x = torch.randn(7, 5)
    debug.record(fn, x, mode="placeholder")
    filled = _C.shape_cache_size()
    debug.record(fn, x, mode="placeholder")
    assert _C.shape_cache_size() == filled  # same ops, same metadata: no new entry
    debug.record(fn, torch.randn(9, 5), mode="placeholder")
    assert _C.shape_cache_size() == filled + 3  # new shapes: mul, sigmoid, cumsum each once


def test_a_float_an_in_place_op_writes_with_costs_no_cache_entry_per_value():
    """The optimizers' per-step floats (a scheduled lr in add_, Adam's step size in addcdiv_, a
    foreach op's scalar list) do not change the written tensors' metadata: one entry for all
    values. Where a float can decide sizes (arange's end) each value is its own entry."""
    p, g, d = torch.randn(6, 4), torch.randn(6, 4), torch.rand(6, 4) + 1

    def step(lr):
        def fn(p, g, d):
            q = p.clone()
            q.add_(g, alpha=-lr)
            q.addcdiv_(g, d, value=-lr / 3)
            torch._foreach_mul_([q, q], [lr, 2 * lr])
            return q
        return fn

    debug.record(step(0.1), p, g, d, mode="placeholder")
    filled = _C.shape_cache_size()
    for k in range(5):
        debug.record(step(0.1 + 0.01 * k), p, g, d, mode="placeholder")
    assert _C.shape_cache_size() == filled  # before: add_, addcdiv_ and _foreach_mul_ per value

    def ramp(end):
        return lambda x: torch.arange(0.0, end) + x.sum()

    debug.record(ramp(4.5), p, mode="placeholder")
    filled = _C.shape_cache_size()
    out, _ = debug.record(ramp(6.5), p, mode="placeholder")
    assert _C.shape_cache_size() > filled  # another end: another size
    assert out.shape == (7,)


def test_bound_placeholder_becomes_an_ordinary_tensor_and_views_see_the_value():
    def fn(x):
        y = x * 2
        return y, y[1:], y.t()

    x = torch.randn(3, 2)
    (y, tail, yt), _ = debug.record(fn, x, mode="placeholder")
    expected = x * 2
    _C.bind_placeholder(y, expected)
    assert not _C.is_placeholder(y)
    assert torch.equal(y, expected) and y.is_cpu
    assert (y.numpy() == expected.numpy()).all()
    # Views share the storage: once bound (with the values they already hold) they read it.
    _C.bind_placeholder(tail, expected[1:])
    _C.bind_placeholder(yt, expected.t())
    assert torch.equal(tail, expected[1:]) and torch.equal(yt, expected.t())
    y.add_(1)  # ordinary tensors again: in-place updates show through their views
    assert torch.equal(tail, expected[1:] + 1)
    with pytest.raises(RuntimeError, match="already bound"):
        _C.bind_placeholder(y, expected)


def test_bind_rejects_mismatched_values():
    (y, _), _ = debug.record(lambda x: (x * 2, None), torch.randn(3), mode="placeholder")
    with pytest.raises(RuntimeError, match="cannot bind a placeholder of aten::mul"):
        _C.bind_placeholder(y, torch.zeros(4))
    with pytest.raises(RuntimeError, match="cannot bind"):
        _C.bind_placeholder(y, torch.zeros(3, dtype=torch.float64))


def test_saved_outputs_unpacked_by_autograd_refer_to_their_producer():
    # relu saves its result for backward; autograd unpacks it as a new tensor object, which
    # must still be recognised as relu's output, not taken for an external input.
    x = torch.randn(4, 3, requires_grad=True)
    _, trace = debug.record(lambda: torch.relu(x * 2).sum().backward())
    relu = next(op for op in trace.ops if op.name == "aten::relu")
    tb = next(op for op in trace.ops if op.name == "aten::threshold_backward")
    saved = next(i for i in tb.inputs if i.argument == 1)  # threshold_backward(grad, self, ...)
    assert (saved.op, saved.output) == (relu.index, 0)
    assert all(i.external is None for i in tb.inputs)


def test_an_op_that_raises_leaves_no_record_and_the_error_reaches_the_user():
    def fn(a, b):
        try:
            torch.mm(a, b)  # shapes do not fit: raises exactly as in eager
        except RuntimeError as e:
            message = str(e)
        return a.sum(), message

    a, b = torch.randn(2, 3), torch.randn(4, 5)
    with pytest.raises(RuntimeError) as eager_error:
        torch.mm(a, b)
    (total, message), trace = debug.record(fn, a, b)
    assert message == str(eager_error.value)
    assert trace.names == ["aten::sum"]
    assert torch.equal(total, a.sum())


def _guarded_lines(fn) -> set[int]:
    import dis
    from terra_torch._locations import guarded_ranges
    lines = set()
    for start, end in guarded_ranges(fn.__code__):
        for ins in dis.get_instructions(fn):
            if start <= ins.offset < end and ins.positions.lineno is not None:
                lines.add(ins.positions.lineno - fn.__code__.co_firstlineno)
    return lines


def test_guarded_ranges_are_the_except_clauses_that_can_catch_a_kernel_error():
    def f(x, ids):
        with torch.no_grad():
            a = x + 1                  # 2: a `with` catches nothing
        try:
            b = x[ids]                 # 4: guarded
        except (IndexError, RuntimeError):
            b = x[ids.clamp(0, 3)]     # 6: the except body is not
        try:
            c = x * 2                  # 8: try/finally re-raises
        finally:
            pass
        try:
            d = x - 1                  # 12: KeyboardInterrupt catches no kernel error
        except KeyboardInterrupt:
            pass
        try:
            e = x / 2                  # 16: a later clause may
        except KeyError:
            pass
        except Exception:
            pass
        try:
            g = x.sum()                # 22: bare except
        except:  # noqa: E722
            pass
        return a, b, c, d, e, g

    assert _guarded_lines(f) == {4, 16, 22}


_WALK_PROGRAM = r'''
import json, sys, torch
from terra_torch import debug

def gen(x):
    for _ in range(2):
        yield torch.relu(x)          # resumed from two different functions below

def first(g):
    return next(g) * 2

def second(g):
    return next(g) + 1

def site(x):
    return torch.tanh(x)

def program(x):
    g = gen(x)
    a, b = first(g), second(g)
    c = site(a)                      # one function, two call sites
    d = site(b)
    e = sum(torch.sigmoid(t) for t in (c, d))  # a generator expression
    return loops((lambda t: t.exp())(e))

def loops(f):
    for i in range(3):               # a loop of the program
        f = f - 1
        for _ in range(2):           # nested (two ops: a body of one op never looks started over)
            f = f * 0.5
            f = f + 1
    return f

_, trace = debug.record(program, torch.randn(3))
loop_ids = {}
out = [[op.name, str(op.location), [[loop_ids.setdefault(lid, len(loop_ids)), it] for lid, it in op.loops]]
       for op in trace.ops]
print(json.dumps(out))
'''


def test_frame_walk_without_the_gil_gives_the_api_walks_locations(tmp_path):
    # On Python 3.11 the location walk reads the interpreter's frame structs without the GIL
    # (capture/program_location.cpp); TERRA_FRAME_WALK=api walks through the C API. Both must give
    # the same frames and loop iterations for every op: generator frames resumed from different
    # callers, one function reached from two sites, a generator expression, a lambda, nested loops.
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "walk.py"
    script.write_text(_WALK_PROGRAM)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    results = {}
    for walk in ("structs", "api"):
        env = dict(os.environ, TERRA_FRAME_WALK=walk, PYTHONPATH=root)
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        results[walk] = json.loads(out.stdout.strip().splitlines()[-1])
    assert results["structs"] == results["api"]
    ops = results["api"]
    relus = [o for o in ops if o[0] == "aten::relu"]
    assert len(relus) == 2 and relus[0][1] != relus[1][1]  # the resuming caller is part of the location
    assert "first" in relus[0][1] and "second" in relus[1][1]
    tanhs = [o for o in ops if o[0] == "aten::tanh"]
    assert len(tanhs) == 2 and tanhs[0][1] != tanhs[1][1]
    muls = [o for o in ops if o[0].startswith("aten::mul") and o[2]]
    assert [tuple(it for _, it in o[2]) for o in muls] == [(i, j) for i in range(3) for j in range(2)]
