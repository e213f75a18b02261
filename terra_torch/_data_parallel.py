"""terra_torch.wrap(DDP(model)): DistributedDataParallel's work done by ops co-execution traces
(docs/DISTRIBUTED.md).

DDP's C++ reducer works inside backward: hooks on the parameters' AccumulateGrad nodes copy each
gradient into a flat bucket (multiplied by 1/world_size), launch an allreduce per bucket on the
process group as soon as the bucket is full, and copy the results back at the end of backward.
Those hooks read gradients' memory and hand Work objects around; a co-executed graph can hold
neither. The same arithmetic, written as tensor ops after backward() returns, can be traced:

    per bucket:  scaled = _foreach_mul(grads, 1/world)                 # zeros where a grad is None
                 reduced = all_reduce_coalesced(scaled, "sum", group)  # _c10d_functional
                 _foreach_copy_(grads, wait_tensor(r) for r in reduced)  # or a new grad, if None

So a wrapped DDP module's forward runs DDP's module directly (DDP's own forward, and with it the
reducer, stays idle: its hooks return at once when no forward prepared them), and every
accumulating backward() that reached the module's parameters ends with the ops above. Every rank
runs the same program, so the collectives come in the same order on every rank; in the graph they
wait for Python's validation (capture/collectives.h), so a rank that diverges issues each of them
exactly once as well. Eager iterations (the speed check's, a fall back's) run the same ops eagerly.

What is kept from eager DDP, and how:
  - the sum: two ranks' gradients add in either order to the same bits, so with 2 processes the
    results are eager DDP's bit for bit. With more, the order in which gloo or NCCL sums a
    bucket's elements depends on the bucket layout, and ours (parameters in reverse order, split
    by dtype and device at `bucket_bytes_cap`) is DDP's first layout, not the one DDP rebuilds
    after its first iteration: the results then agree to rounding;
  - `no_sync()`: the forward decides, as in DDP (`require_backward_grad_sync` at forward time);
  - buffers: broadcast from the group's rank 0 before each forward that DDP would broadcast
    before (`broadcast_buffers`, skipped after a forward under no_sync or no_grad);
  - `find_unused_parameters=True`: which parameters a rank used is allreduced as well; a
    parameter no rank used keeps its `.grad` untouched, one another rank used gets the reduced
    gradient (a new `.grad` if it had none). This needs one read of the used map, in iterations
    where some parameter was unused on this rank, as in eager DDP;
  - parameters DDP ignores (`_set_params_and_buffers_to_ignore_for_model`) are left alone.

Left to eager DDP (the model then runs eagerly, with the reason logged): communication hooks,
static_graph, mixed precision, delayed all-reduce, sparse gradients. DDP's Join context raises.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Sequence

import torch
import torch.distributed as dist

from terra_torch import _C

logger = logging.getLogger("terra_torch")


def unsupported(ddp: Any) -> str | None:
    """Why this DDP module cannot be lowered (None: it can)."""
    if getattr(ddp, "_comm_hooks", None):
        return "a communication hook is registered (register_comm_hook)"
    try:
        hook = ddp.logger._get_ddp_logging_data().strs_map.get("comm_hook")
    except Exception:  # (an older DDP without logging data: nothing to learn there)
        hook = None
    if hook:
        return f"a communication hook is registered ({hook})"
    if hasattr(ddp, "buffer_hook"):
        return "a buffer communication hook is registered"
    for attribute, what in (("static_graph", "static_graph=True"), ("mixed_precision", "mixed_precision"),
                            ("_delay_all_reduce_params", "delay_all_reduce_named_params"),
                            ("_use_python_reducer", "the Python reducer (compiled autograd's DDP mode)")):
        if getattr(ddp, attribute, None):
            return f"{what} is not lowered"
    for module in ddp.module.modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            return f"{type(module).__name__}(sparse=True) has sparse gradients"
    return None


class Lowering:
    """One DDP module's forward and gradient reduction as traceable ops."""

    def __init__(self, ddp: Any) -> None:
        self.ddp = ddp
        group = ddp.process_group
        self.group_name: str = group.group_name
        self.world: int = group.size()
        self.root: int = dist.get_global_rank(group, 0)  # the group's rank 0 holds the buffers
        self.params: list[torch.Tensor] = [p for p in ddp._module_parameters if p.requires_grad]
        self.buckets: list[list[int]] = _buckets(self.params, ddp.bucket_bytes_cap)
        self.find_unused: bool = bool(ddp.find_unused_parameters)
        self.pending = False  # a forward asked for the next backward to reduce gradients
        self.used: set[int] = set()  # indices of parameters a backward reached since the last reduction
        self.missing: str | None = None  # the error eager DDP raises at the next forward
        # The reducer stays idle (DDP's forward no longer runs): its hooks need not stop
        # backward() from being replayed without the autograd engine.
        _C.runtime.tolerate_idle_reducer_hooks(self.params, True)
        # Given back before the reducer is destroyed with its module (it deletes its hooks by
        # address), if terra_torch.unwrap does not come first.
        self._give_back = weakref.finalize(ddp, _C.runtime.tolerate_idle_reducer_hooks, list(self.params), False)
        # Weakly held (the module's forward holds the lowering), in creation order: two
        # modules reduced by one backward reduce in the same order on every rank.
        _lowerings.append(weakref.ref(self))

    # ---- forward -------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        ddp = self.ddp
        if ddp._join_config.enable:
            raise RuntimeError("terra_torch: DDP's Join context is not supported under terra_torch.wrap(DDP(model)); "
                               "unwrap the model (terra_torch.unwrap) to train with uneven inputs")
        if self.missing is not None:
            missing, self.missing = self.missing, None
            raise RuntimeError(missing)
        if ddp.device_ids:
            inputs, kwargs = _to_device(ddp, inputs, kwargs)
        if ddp.will_sync_module_buffers():
            self._broadcast_buffers()
        output = ddp.module(*inputs, **kwargs)
        syncing = torch.is_grad_enabled() and ddp.require_backward_grad_sync
        ddp.require_forward_param_sync = syncing
        if syncing:
            self.pending = True
        return output

    def _broadcast_buffers(self) -> None:
        ddp = self.ddp
        ddp._assign_modules_buffers()  # (buffers may have been reassigned, as DDP notes)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(ddp.modules_buffers)):
            for buffer in ddp.modules_buffers:
                dist.broadcast(buffer, self.root, group=ddp.process_group)

    # ---- after backward ------------------------------------------------------------------------

    def after_backward(self, reached: set[int]) -> None:
        """A backward() completed that reached the leaves whose ids are `reached`."""
        now = {i for i, p in enumerate(self.params) if id(p) in reached}
        if not now:
            return  # not this module's backward (a GAN's other network)
        self.used |= now
        if not self.pending:
            return  # under no_sync (or a second backward of one forward): gradients accumulate
        self.pending = False
        used, self.used = self.used, set()
        self._reduce(now, used)

    def _reduce(self, now: set[int], used: set[int]) -> None:
        """`now`: the parameters this backward reached; `used`: those any backward reached since
        the last reduction (the no_sync ones too, as DDP's used map counts them)."""
        params, world = self.params, self.world
        if not self.find_unused and len(now) < len(params):
            unused = [i for i in range(len(params)) if i not in now]
            # Eager DDP's reducer would wait for these gradients forever and raise at the next
            # forward; so do we (no collective is issued, as in eager).
            self.missing = (
                "terra_torch (DDP): Expected to have finished reduction in the prior iteration before starting a new "
                f"one: parameters with indices {unused} received no gradient. Pass find_unused_parameters=True to "
                "DistributedDataParallel if some parameters are unused in some iterations")
            return
        globally_used: list[int] | None = None
        if self.find_unused:
            local = torch.tensor([1 if i in used else 0 for i in range(len(params))], dtype=torch.int32)
            dist.all_reduce(local, group=self.ddp.process_group)
            if len(used) < len(params):
                globally_used = local.tolist()  # waits for the used map (eager DDP does too)
        scale = 1.0 / world
        functional = torch.ops._c10d_functional
        with torch.no_grad():
            for bucket in self.buckets:
                # Few ops per bucket (each traced op costs Python time): one multiply, one
                # coalesced allreduce (gloo and NCCL flatten it into one buffer, as DDP's bucket
                # is), one wait per tensor, one copy back.
                grads = [params[i].grad if params[i].grad is not None else
                         torch.zeros_like(params[i]) for i in bucket]
                reduced = functional.all_reduce_coalesced(torch._foreach_mul(grads, scale), "sum", self.group_name)
                reduced = [functional.wait_tensor(t) for t in reduced]
                into, values = [], []
                for i, value in zip(bucket, reduced):
                    p = params[i]
                    if globally_used is not None and not globally_used[i]:
                        continue  # no rank used it: .grad stays as it is
                    if p.grad is None:
                        p.grad = torch.empty_like(p).copy_(value)
                    else:
                        into.append(p.grad)
                        values.append(value)
                if into:
                    torch._foreach_copy_(into, values)

    def close(self) -> None:
        """DDP's own forward and reducer take over again (terra_torch.unwrap)."""
        _lowerings[:] = [r for r in _lowerings if r() is not None and r() is not self]
        self._give_back()  # (once: a finalizer runs at most once)


_lowerings: list[weakref.ref[Lowering]] = []


def after_backward(roots: Sequence[torch.Tensor]) -> None:
    """Called once a backward() that accumulates into `.grad` has completed (terra_torch/_backward.py)."""
    if not _lowerings:
        return
    tensors = [t for t in roots if isinstance(t, torch.Tensor)]
    reached = {id(t) for t in _C.runtime.leaves_reached(tensors)}
    for ref in list(_lowerings):
        lowering = ref()
        if lowering is None:
            _lowerings.remove(ref)
        else:
            lowering.after_backward(reached)


def _buckets(params: list[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """DDP's first bucket layout: parameters in reverse order, one dtype and device per bucket,
    a new bucket once `cap_bytes` is reached."""
    buckets: list[list[int]] = []
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.dtype, p.device)
        bucket, size = open_.get(key, ([], 0))
        if not bucket:
            buckets.append(bucket)
        bucket.append(i)
        size += p.numel() * p.element_size()
        open_[key] = (bucket, size) if size < cap_bytes else ([], 0)
    return [b for b in buckets if b]


def _to_device(ddp: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What DDP's forward does with device_ids: inputs move to the module's device."""
    from torch.nn.parallel.distributed import _to_kwargs
    moved, moved_kwargs = _to_kwargs(inputs, kwargs, torch.device(ddp.device_type, ddp.device_ids[0]),
                                     ddp.use_side_stream_for_tensor_copies)
    return moved[0], moved_kwargs[0]
