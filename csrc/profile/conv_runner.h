// The per-call path of a convolution under a profile record (issue 17, items 3 and 4).
//
//   hit:  the thread's plan cache has a plan for this exact problem -> execute it. Nothing is
//         looked up, formatted, allocated or locked (the Selector's counters are atomics).
//   miss: the record key is derived from the PlanKey, then configurations are built and run in
//         this order until one runs, and its plan is cached:
//           1. the record's ranked configurations (profiled now, at this batch, if the key is
//              new), then its least-memory one: a configuration recorded at another batch size
//              that does not build or run here falls back to the next;
//           2. the backend's heuristic choices (cuDNN heuristic mode A), untimed;
//           3. for an entry that came from the record, a re-profile at this batch size.
//         If nothing runs the outcome says why and the caller hands the call to PyTorch.
// A cached plan that stops running (out of memory) is dropped and the miss path runs without it.
#pragma once

#include "profile/plan_cache.h"
#include "profile/plan_key.h"
#include "profile/provider.h"
#include "profile/selector.h"

namespace terra::profile {

Outcome run_convolution(Selector& selector, const PlanKey& key, Provider& provider, PlanCache& cache);

}  // namespace terra::profile
