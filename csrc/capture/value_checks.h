// Ops whose kernels check the *values* of their tensor arguments and raise on bad data: an index
// out of range (embedding, gather, index_put_), a class target out of range (nll_loss), a
// probability outside [0, 1] (binary_cross_entropy), a matrix that is not positive definite
// (cholesky). Ops that draw random numbers (bernoulli, multinomial) are left out: checking one
// first would run it, and draw, twice. A placeholder's shape inference cannot see these errors, so in
// co-execution they would only surface on the graph's thread, after Python had gone on. Where
// the program catches what such an op raises (an except clause around it), co-execution checks
// the arguments before the graph may run the op (docs/RUNTIME.md, "Errors only the data can
// raise"). The list errs on the side of including an op: a needless check costs a wait.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>

#include "trace/hash.h"

namespace terra::capture {

bool checks_argument_values(const c10::OperatorHandle& op);

// Whether such an op checks only the values of its integer and boolean tensors (indices,
// targets, masks, counts): an index out of range raises whatever the floating-point tensors hold,
// so a check needs only their shapes (embedding's weight, nll_loss's input). False for the ops
// that check floating-point values (binary_cross_entropy, the factorizations, the asserts).
bool checks_only_index_values(const c10::OperatorHandle& op);

// Names one op at one program location across the iterations of a process (the operator's
// schema lives as long as its registration): the unit co-execution learns "raised here" for.
inline uint64_t check_key(uint64_t location, const c10::OperatorHandle& op) {
  return trace::hash_combine(location, reinterpret_cast<uintptr_t>(&op.schema()));
}

}  // namespace terra::capture
