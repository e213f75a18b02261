// What an op's schema says about aliasing, per result: which argument a result aliases and
// whether the op writes through it (`Tensor(a!) self -> Tensor(a!)`: in place; `Tensor(a) self ->
// Tensor(a)`: a view). Asked by shape inference (placeholders of views and in-place results), by
// the segment cutter (emit/segments.cpp) and by the FusedExecutor (which inputs a segment writes).
// (A header of its own rather than op_arguments.h: that one is included nearly everywhere.)
#pragma once

#include <ATen/core/function_schema.h>

#include <cstddef>
#include <optional>

namespace terra::capture {

struct AliasedArgument {
  size_t argument = 0;
  bool written = false;  // true: an in-place (or out=) result, the argument itself
};

// The argument result `ret` aliases (same alias set), or nullopt for a fresh result.
inline std::optional<AliasedArgument> aliased_argument(const c10::FunctionSchema& schema, size_t ret) {
  if (ret >= schema.returns().size()) return std::nullopt;
  const c10::AliasInfo* info = schema.returns()[ret].alias_info();
  if (info == nullptr) return std::nullopt;
  for (size_t a = 0; a < schema.arguments().size(); ++a) {
    const c10::AliasInfo* arg = schema.arguments()[a].alias_info();
    if (arg != nullptr && arg->beforeSets() == info->beforeSets()) return AliasedArgument{a, info->isWrite()};
  }
  return std::nullopt;
}

// Argument `a` is written by the op.
inline bool writes_argument(const c10::FunctionSchema& schema, size_t a) {
  return a < schema.arguments().size() && schema.arguments()[a].alias_info() != nullptr &&
         schema.arguments()[a].alias_info()->isWrite();
}

// Every result is a view of an argument, or a list of views (`unbind.int(Tensor(a -> *) self) ->
// Tensor(a)[]`, whose alias set sits on the list's elements, so aliased_argument() finds no
// argument for it), and the op writes none. Looser than makes_views_only(), which needs each
// result's argument.
inline bool results_are_views(const c10::FunctionSchema& schema) {
  if (schema.returns().empty()) return false;
  for (size_t a = 0; a < schema.arguments().size(); ++a)
    if (writes_argument(schema, a)) return false;
  for (const c10::Argument& ret : schema.returns())
    if (ret.alias_info() == nullptr || ret.alias_info()->isWrite()) return false;
  return true;
}

// The op only makes views: every result aliases an argument, and it writes none.
inline bool makes_views_only(const c10::FunctionSchema& schema) {
  for (size_t a = 0; a < schema.arguments().size(); ++a) {
    if (writes_argument(schema, a)) return false;
  }
  for (size_t r = 0; r < schema.returns().size(); ++r) {
    if (!aliased_argument(schema, r)) return false;
  }
  return true;
}

}  // namespace terra::capture
