#include "capture/value_checks.h"

#include <array>
#include <string_view>

namespace terra::capture {

namespace {

// Base names: overloads and the in-place variant (trailing underscore) check the same way.
std::string_view base_name(const c10::OperatorHandle& op) {
  std::string_view name = op.operator_name().name;
  if (name.starts_with("aten::")) name.remove_prefix(6);
  if (name.size() > 1 && name.back() == '_' && name[name.size() - 2] != '_') name.remove_suffix(1);
  return name;
}

}  // namespace

bool checks_only_index_values(const c10::OperatorHandle& op) {
  static constexpr std::array<std::string_view, 10> kValueChecks = {
      "binary_cross_entropy", "ctc_loss", "_ctc_loss", "cholesky", "linalg_cholesky", "inverse", "linalg_inv",
      "linalg_solve", "_assert_async", "_assert_scalar"};
  if (!checks_argument_values(op)) return false;
  const std::string_view name = base_name(op);
  for (std::string_view n : kValueChecks)
    if (n == name) return false;
  return true;
}

bool checks_argument_values(const c10::OperatorHandle& op) {
  static constexpr std::array<std::string_view, 41> kNames = {
      "embedding", "embedding_bag", "_embedding_bag", "_embedding_bag_forward_only",
      "index", "index_select", "index_put", "_index_put_impl", "index_add", "index_copy",
      "index_fill", "index_reduce", "gather", "scatter", "scatter_add", "scatter_reduce",
      "take", "take_along_dim", "put", "masked_scatter", "one_hot", "bincount",
      "repeat_interleave", "nll_loss", "nll_loss_forward", "nll_loss2d", "nll_loss2d_forward",
      "nll_loss_nd", "cross_entropy_loss", "multi_margin_loss", "multilabel_margin_loss_forward",
      "binary_cross_entropy", "ctc_loss", "_ctc_loss", "cholesky", "linalg_cholesky", "inverse", "linalg_inv", "linalg_solve", "_assert_async",
      "_assert_scalar"};
  const std::string_view name = base_name(op);
  for (std::string_view n : kNames)
    if (n == name) return true;
  return false;
}

}  // namespace terra::capture
