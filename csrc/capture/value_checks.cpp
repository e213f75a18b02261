#include "capture/value_checks.h"

#include <array>
#include <string_view>

namespace terra::capture {

bool checks_argument_values(const c10::OperatorHandle& op) {
  // Base names: overloads and the in-place variant (trailing underscore) check the same way.
  static constexpr std::array<std::string_view, 41> kNames = {
      "embedding", "embedding_bag", "_embedding_bag", "_embedding_bag_forward_only",
      "index", "index_select", "index_put", "_index_put_impl", "index_add", "index_copy",
      "index_fill", "index_reduce", "gather", "scatter", "scatter_add", "scatter_reduce",
      "take", "take_along_dim", "put", "masked_scatter", "one_hot", "bincount",
      "repeat_interleave", "nll_loss", "nll_loss_forward", "nll_loss2d", "nll_loss2d_forward",
      "nll_loss_nd", "cross_entropy_loss", "multi_margin_loss", "multilabel_margin_loss_forward",
      "binary_cross_entropy", "ctc_loss", "_ctc_loss", "cholesky", "linalg_cholesky", "inverse", "linalg_inv", "linalg_solve", "_assert_async",
      "_assert_scalar"};
  std::string_view name = op.operator_name().name;
  if (name.starts_with("aten::")) name.remove_prefix(6);
  if (name.size() > 1 && name.back() == '_' && name[name.size() - 2] != '_') name.remove_suffix(1);
  for (std::string_view n : kNames)
    if (n == name) return true;
  return false;
}

}  // namespace terra::capture
