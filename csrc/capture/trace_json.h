// Writing a captured trace as JSON and reading it back, for warm start: a restarted job merges
// the traces an earlier run kept (runtime/session.h, export_program) instead of tracing again.
//
// What makes a trace mean the same in another process:
// - operators by name and overload (looked up in the dispatcher again);
// - attributes by value, floats by their bits (what a record hashes stays what it hashed);
// - locations and loop ids as they are, since they are built from code identities, not
//   addresses (capture/program_location.h);
// - external tensors by a token the writer chooses (equal tokens: the same object, as the
//   TensorImpl address said in the writing process) and their first reader; the undefined
//   tensor that stands for None in a Tensor?[] argument by a flag.
//
// Example: {"ops": [{"op": "aten::mm", "overload": "", "attrs": [], "attr_args": [], "hash": ..,
// "in": [[0, -1, -1, -1, 0], [1, -1, -1, -1, 1]], "out": [[6, 0, -1, [8, 4], [4, 1], 0, true]],
// "loc": .., "loops": [], ...}], "externals": [{"meta": [..], "token": 1, "reader": .., ...}]}
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>

#include "capture/trace_record.h"

namespace terra::capture {

// Throws std::invalid_argument naming the op and attribute that has no written form (a
// torch.Generator, a Python object): such a program is not kept.
nlohmann::json trace_to_json(const Trace& trace, const std::function<uint64_t(const void*)>& token_of);

// Throws std::invalid_argument on anything malformed or unknown (an operator this process does
// not have). The externals' identity holds a token (ExternalInput::identity says: no address).
Trace trace_from_json(const nlohmann::json& j);

}  // namespace terra::capture
