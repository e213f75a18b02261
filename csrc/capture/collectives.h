// c10d's in-place collectives inside a capture region, as functional collectives.
//
// `torch.distributed.all_reduce(t)` reaches the dispatcher as `c10d::allreduce_(tensors, group,
// op, ...) -> (Tensor[], Work)`: it writes its tensors and hands back a Work, a custom-class
// object a TorchScript graph cannot produce. The same collective written functionally,
//
//     r = _c10d_functional::all_reduce(t, "sum", group_name)
//     t.copy_(_c10d_functional::wait_tensor(r))
//
// is three ordinary ops the region traces and the graph runs (torch.compile rewrites
// `dist.all_reduce` the same way, torch/distributed/_functional_collectives.py). So inside a region
// the in-place op issues those three and returns its tensors with a Work that is already complete:
// the values are the graph's, and whoever reads them waits for the graph as for any placeholder.
// Every collective is a side effect the graph runs only after Python has validated it
// (emit::has_side_effect), so each one runs exactly once per rank, in program order, whether the
// graph or Python (after a divergence) issues it.
//
// Lowered: allreduce_ (sum, product, min, max, avg), broadcast_, allgather_ (dist.all_gather of
// one tensor) and _allgather_base_ (dist.all_gather_into_tensor) of dense tensors. Any other
// c10d op inside a region runs for real after the graph has finished what Python validated
// (capture::is_collective; Region::co_execute), so the order of collectives is kept there too.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace terra::capture {

// The op is one of c10d's process-group ops (a collective, a barrier, a send or a receive), in
// any of the namespaces torch registers them under.
bool is_collective(const c10::OperatorHandle& op);

}  // namespace terra::capture
