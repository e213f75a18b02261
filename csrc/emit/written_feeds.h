// Which feeds the generated graph may write into (FeedSlot::written).
//
// A fed tensor is memory from outside the iteration. Where that memory is a numpy array, a
// DLPack import or a Python buffer (torch.from_numpy, torch.frombuffer), Python can overwrite it
// without an op: `buf[:] = next_batch` while the graph has not yet read the previous batch. The
// runtime then feeds a copy taken when Python validated the read (runtime/feed_snapshot.h), as
// eager read it then. A copy would also take the graph's writes away from that memory (a
// normalisation in place, `x.sub_(mean)`, which eager makes visible through the array), so
// feeds the graph writes, directly or through a view, are fed as they are.
//
// Example: in
//     %x = terra::feed(3)
//     %v = aten::select(%x, 0, 1)        (a view of %x)
//     %y = aten::mul_(%v, 2.0)           (writes %v, so %x)
// slot 3 is written; in `%y = aten::mul(%x, 2.0)` it is not.
//
// Read from the ops' schemas (alias annotations): a use with a write annotation writes; a use
// that returns an alias of its argument (a view) passes the question on to that output; so do
// the branches and the casts of feed_or_none's If. Whatever cannot be followed (loop-carried
// values, lists, tuples, ops without a schema, terra::boxed_call) counts as written, which only
// means "fed as it is", what every feed did before.
#pragma once

#include "emit/emitted_graph.h"

namespace terra::emit {

// Sets `written` on every FeedSlot of `out` from out.graph.
void mark_written_feeds(EmittedGraph& out);

}  // namespace terra::emit
