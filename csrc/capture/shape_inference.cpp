#include "capture/shape_inference.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/as_strided.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <array>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "capture/meta_functions.h"
#include "capture/placeholder.h"
#include "capture/schema_aliases.h"
#include "capture/terra_key.h"

namespace terra::capture {

namespace {

// Built on the stack: the key of an ordinary op (two or three tensors of up to 4 dims) fits.
using Key = c10::SmallVector<int64_t, 48>;

uint64_t hash_key(c10::ArrayRef<int64_t> k) {
  uint64_t h = 1469598103934665603ULL;
  for (int64_t v : k) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ULL;
  return h;
}

struct CacheEntry {
  std::vector<int64_t> key;
  InferredOutputs outputs;
};

// Keyed by the hash; the full key is compared so that a collision cannot give wrong shapes.
// Entries are never erased, so references handed out stay valid.
std::mutex cache_mu;
std::unordered_map<uint64_t, std::vector<std::unique_ptr<CacheEntry>>> cache;
size_t cache_entries = 0;  // under cache_mu
// Each thread's last hits, direct-mapped by the key's hash: a hit here takes no lock and no
// unordered_map probe (the shared cache's mutex and bucket walk were a third of a hit's cost in
// a co-executed step). It holds pointers into `cache`, whose entries are never erased; a slot is
// trusted only after its entry's full key compares equal.
constexpr size_t kRecentSlots = 256;
thread_local std::array<const CacheEntry*, kRecentSlots> t_recent{};
// Layouts of real runs (learn_layouts), by the same key as the cache: what the real kernel gave
// each output, where the op has no C++ meta function. Under cache_mu.
struct LearnedLayout {
  std::vector<int64_t> key;
  std::vector<TensorMeta> outputs;  // every tensor output, lists flattened, in order
};
std::unordered_map<uint64_t, std::vector<LearnedLayout>> learned;
// The same by the inputs' layouts alone (layout_pattern: sizes left out), for metadata no real
// run has had yet (an epoch's short last batch seen first in co-execution): each output's order
// of dimensions, where the real one was dense with distinct strides (else empty).
struct LearnedOrder {
  std::vector<int64_t> key;  // the pattern (build_pattern)
  std::vector<c10::SmallVector<int64_t, 6>> orders;
};
std::unordered_map<uint64_t, std::vector<LearnedOrder>> learned_orders;
size_t layouts_corrected = 0;  // entries a learned layout changed (shape_cache_counts)
// What misses ran (shape_cache_counts); counted outside the lock, as the meta call runs there.
std::atomic<size_t> cpp_meta_calls{0}, dispatched_calls{0};

void key_tensor(Key& key, const at::Tensor& t) {
  if (!t.defined()) { key.push_back(-7); return; }
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  const c10::Device device = impl->device();
  const c10::IntArrayRef sizes = impl->sizes(), strides = impl->strides();
  key.push_back(static_cast<int64_t>(t.scalar_type()));
  key.push_back(static_cast<int64_t>(device.type()) * 256 + device.index());
  key.push_back(static_cast<int64_t>(sizes.size()));
  key.append(sizes.begin(), sizes.end());
  key.append(strides.begin(), strides.end());
  key.push_back(impl->storage_offset());
  key.push_back(impl->is_wrapped_number() + 2 * impl->is_conj() + 4 * impl->is_neg());
}

// `float_values`: whether the values of floats (not only that they are floats) go into the key.
void key_ivalue(Key& key, const c10::IValue& v, bool float_values) {
  key.push_back(static_cast<int64_t>(v.tag));
  if (v.isTensor()) {
    key_tensor(key, v.toTensor());
  } else if (v.isTensorList()) {
    for (const c10::IValue& e : v.toListRef()) key_tensor(key, e.toTensor());  // (no copy of the list)
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) key_ivalue(key, e, float_values);
  } else if (v.isInt()) {
    key.push_back(v.toInt());
  } else if (v.isDouble()) {
    if (!float_values) return;
    double d = v.toDouble();
    int64_t bits;
    std::memcpy(&bits, &d, sizeof bits);
    key.push_back(bits);
  } else if (v.isBool()) {
    key.push_back(v.toBool());
  } else if (v.isDevice()) {
    key.push_back(static_cast<int64_t>(v.toDevice().type()) * 256 + v.toDevice().index());
  } else if (v.isString()) {
    key.push_back(static_cast<int64_t>(std::hash<std::string>()(v.toStringRef())));
  } else if (v.isSymInt()) {
    key.push_back(v.toSymInt().expect_int());
  }
  // None, Generator and the rest do not change output metadata: the tag is enough.
}

at::Tensor to_meta(const at::Tensor& t) {
  if (!t.defined()) return t;
  auto options = at::TensorOptions().dtype(t.scalar_type()).device(c10::kMeta);
  // A Python scalar the arg parser wrapped stays as it is: a CPU scalar mixes with meta tensors,
  // keeps its wrapped-number rank in type promotion (float32 * 0.5 stays float32), and Python
  // meta kernels can turn it back into a number.
  if (t.unsafeGetTensorImpl()->is_wrapped_number()) return t;
  at::Tensor meta;
  if (t.storage_offset() == 0) {
    meta = at::empty_strided(t.sizes(), t.strides(), options);
  } else {
    int64_t extent = t.storage_offset() + 1;
    for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
    meta = at::empty({extent}, options).as_strided(t.sizes(), t.strides(), t.storage_offset());
  }
  // (views keep their base's math bits: z.conj().transpose(0, 1) is conjugated too)
  if (t.is_conj()) meta._set_conj(true);
  if (t.is_neg()) meta._set_neg(true);
  return meta;
}

c10::IValue ivalue_to_meta(const c10::IValue& v) {
  if (v.isTensor()) return to_meta(v.toTensor());
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList().vec()) out.push_back(to_meta(t));
    return out;
  }
  if (v.isOptionalTensorList()) {
    c10::List<std::optional<at::Tensor>> out;
    for (const c10::IValue& e : v.toListRef())
      out.push_back(e.isNone() ? std::nullopt : std::optional<at::Tensor>(to_meta(e.toTensor())));
    return out;
  }
  if (v.isDevice()) return c10::Device(c10::kMeta);
  if (v.isGenerator()) return c10::IValue();  // meta kernels draw nothing
  return v;
}

// The device outputs live on: an explicit `device` argument, else the first tensor input's.
c10::Device output_device(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args) {
  for (size_t i = 0; i < args.size(); ++i) {
    if (schema.arguments()[i].name() == "device" && args[i].isDevice()) return args[i].toDevice();
  }
  for (const c10::IValue& v : args) {
    if (v.isTensor() && v.toTensor().defined()) return v.toTensor().device();
    if (v.isTensorList() && v.toTensorList().size() > 0) return v.toTensorList().get(0).device();
  }
  return c10::Device(c10::kCPU);
}

InferredOutputs cannot_infer(const c10::OperatorHandle& op, const std::string& why) {
  InferredOutputs result;
  result.needs_materialization = true;
  result.reason = c10::toString(op.operator_name()) +
                  " has no shape without its data (data-dependent output or no meta kernel): " + why;
  return result;
}

InferredOutputs run_on_meta(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) {
  SuspendGuard no_interception;  // the meta tensors and the meta call are ours, not the user's
  const auto& schema = op.schema();
  InferredOutputs result;
  // An op that returns nothing (_fused_sgd_, the _foreach_*_ ops) has no output to describe; its
  // effect is on its arguments, whose metadata it keeps. (Several have no meta kernel, and "run
  // it for real" would apply the update twice: once here and once in the graph.)
  if (schema.returns().empty()) return result;
  for (const auto& ret : schema.returns()) {
    auto kind = ret.type()->kind();
    bool tensor = kind == c10::TypeKind::TensorType;
    bool list = kind == c10::TypeKind::ListType &&
                ret.type()->containedType(0)->kind() == c10::TypeKind::TensorType;
    if (!tensor && !list) {
      result.needs_materialization = true;
      result.reason = c10::toString(op.operator_name()) + " returns a " + ret.type()->str() +
                      ", a value only the real computation can give";
      return result;
    }
  }
  torch::jit::Stack meta_stack;
  meta_stack.reserve(args.size());
  for (const c10::IValue& v : args) meta_stack.push_back(ivalue_to_meta(v));
  try {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    if (const c10::KernelFunction* direct = cpp_meta_function(op)) {  // (capture/meta_functions.h)
      direct->callBoxed(op, c10::DispatchKeySet(c10::DispatchKey::Meta), &meta_stack);
      cpp_meta_calls.fetch_add(1, std::memory_order_relaxed);
    } else {
      op.callBoxed(meta_stack);
      dispatched_calls.fetch_add(1, std::memory_order_relaxed);
    }
  } catch (const c10::Error& e) {
    // No meta kernel, a data-dependent output, or arguments the meta kernel refuses (whose
    // message need not be eager's): the op needs its data, and running it for real raises
    // eager's error if there is one.
    return cannot_infer(op, e.what_without_backtrace());
  } catch (const std::exception& e) {  // a meta kernel written in Python raised
    return cannot_infer(op, e.what());
  }
  c10::Device device = output_device(schema, args);
  for (size_t r = 0; r < schema.returns().size(); ++r) {
    ReturnSpec spec;
    auto alias = aliased_argument(schema, r);
    auto describe = [&](const at::Tensor& t) {
      OutputSpec out;
      out.meta = meta_of(t);
      out.meta.device = device;
      out.meta.requires_grad = false;  // autograd, above us, decides
      out.conj = t.is_conj();
      out.neg = t.is_neg();
      if (alias) {
        out.kind = alias->written ? OutputSpec::Kind::SameAsArgument : OutputSpec::Kind::ViewOfArgument;
        out.argument = static_cast<int>(alias->argument);
        if (alias->written && args[alias->argument].isTensor()) {
          const c10::TensorImpl* before = args[alias->argument].toTensor().unsafeGetTensorImpl();
          out.restrides = before->sizes() != c10::IntArrayRef(out.meta.sizes) ||
                          before->strides() != c10::IntArrayRef(out.meta.strides) ||
                          before->storage_offset() != out.meta.storage_offset;
          result.restrides = result.restrides || out.restrides;
        }
      }
      return out;
    };
    const c10::IValue& v = meta_stack[r];
    if (v.isTensor()) {
      spec.tensors.push_back(describe(v.toTensor()));
    } else {
      spec.is_list = true;
      for (const at::Tensor& t : v.toTensorList().vec()) spec.tensors.push_back(describe(t));
    }
    for (const OutputSpec& out : spec.tensors) {
      ++result.num_outputs;
      if (out.meta.dtype == c10::ScalarType::Undefined) continue;  // (an optional output the op left out)
      int64_t n = 1;
      for (const int64_t s : out.meta.sizes) n *= s;
      result.fewest_elements = std::min(result.fewest_elements, n);
    }
    result.returns.push_back(std::move(spec));
  }
  return result;
}

// A real run's layout for the fresh outputs of `result` (those that alias no argument), where
// the sizes agree: the real kernel's answer wins over the meta kernel's. Under cache_mu.
// Returns whether it changed anything.
bool take_layout(InferredOutputs& result, const std::vector<TensorMeta>& real) {
  bool changed = false;
  size_t k = 0;
  for (ReturnSpec& spec : result.returns)
    for (OutputSpec& out : spec.tensors) {
      const size_t i = k++;
      if (out.kind != OutputSpec::Kind::Fresh || i >= real.size() || real[i].sizes != out.meta.sizes) continue;
      if (real[i].strides == out.meta.strides && real[i].storage_offset == out.meta.storage_offset) continue;
      // Elements are overwritten in place, never resized: another thread may be reading this
      // entry without the lock (t_recent), and it reads either stride, each a valid layout.
      std::copy(real[i].strides.begin(), real[i].strides.end(), out.meta.strides.begin());
      out.meta.storage_offset = real[i].storage_offset;
      changed = true;
    }
  return changed;
}

// Dimensions from the outermost (largest stride) in; ties by position. `strict`: empty unless
// the layout is dense with distinct strides and no size-1 dimension, so that the order alone
// gives back the strides (dense_strides).
c10::SmallVector<int64_t, 6> dim_order(c10::IntArrayRef sizes, c10::IntArrayRef strides, bool strict) {
  c10::SmallVector<int64_t, 6> order;
  for (int64_t d = 0; d < static_cast<int64_t>(sizes.size()); ++d) order.push_back(d);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return strides[a] > strides[b]; });
  if (!strict) return order;
  int64_t expected = 1;
  for (auto d = order.rbegin(); d != order.rend(); ++d) {
    if (sizes[*d] < 2 || strides[*d] != expected) return {};
    expected *= sizes[*d];
  }
  return order;
}

// A key like build_key's, without sizes or int-list values: the op, each tensor's dtype, device
// and order of dimensions, and the scalar arguments.
void build_pattern(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, Key& key) {
  key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(&op.schema())));
  auto tensor = [&](const at::Tensor& t) {
    if (!t.defined()) return key.push_back(-7);
    key.push_back(static_cast<int64_t>(t.scalar_type()));
    key.push_back(static_cast<int64_t>(t.device().type()) * 256 + t.device().index());
    key.push_back(t.dim());
    for (int64_t d : dim_order(t.sizes(), t.strides(), false)) key.push_back(d);
  };
  for (const c10::IValue& v : args) {
    key.push_back(static_cast<int64_t>(v.tag));
    if (v.isTensor()) tensor(v.toTensor());
    else if (v.isTensorList()) for (const c10::IValue& e : v.toListRef()) tensor(e.toTensor());
    else if (v.isList()) key.push_back(static_cast<int64_t>(v.toListRef().size()));
    else if (v.isInt()) key.push_back(v.toInt());
    else if (v.isBool()) key.push_back(v.toBool());
  }
}

// The learned order of each fresh output, for metadata no real run had: dense strides in that
// order for the meta kernel's sizes. Under cache_mu.
bool take_order(InferredOutputs& result, const std::vector<c10::SmallVector<int64_t, 6>>& orders) {
  bool changed = false;
  size_t k = 0;
  for (ReturnSpec& spec : result.returns)
    for (OutputSpec& out : spec.tensors) {
      const size_t i = k++;
      if (out.kind != OutputSpec::Kind::Fresh || i >= orders.size() || orders[i].empty() ||
          orders[i].size() != out.meta.sizes.size() || out.meta.storage_offset != 0)
        continue;
      int64_t stride = 1;
      for (auto d = orders[i].rbegin(); d != orders[i].rend(); ++d) {
        if (out.meta.strides[*d] != stride) changed = true;
        out.meta.strides[*d] = stride;
        stride *= std::max<int64_t>(out.meta.sizes[*d], 1);
      }
    }
  return changed;
}

// The entry of `table` (keyed by hash, then by the full key in `.key`) for `key`, or nullptr.
template <class Entry>
const Entry* find_entry(const std::unordered_map<uint64_t, std::vector<Entry>>& table, c10::ArrayRef<int64_t> key) {
  auto it = table.find(hash_key(key));
  if (it == table.end()) return nullptr;
  for (const Entry& e : it->second)
    if (c10::ArrayRef<int64_t>(e.key) == key) return &e;
  return nullptr;
}

// The cache key of `op` on `args`.
void build_key(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, Key& key) {
  const c10::FunctionSchema& schema = op.schema();
  key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(&schema)));
  // The outputs of an op that writes every one of them into an argument (add_, addcdiv_) are
  // those arguments: a float changes their values, never their metadata (no in-place op that
  // changes metadata, unsqueeze_ or resize_, takes one). Keyed by value, the optimizers' per-step floats (a scheduled lr, Adam's step size while its bias
  // correction moves) missed the cache every step, and each miss ran the meta kernel, some of
  // them in Python (Adam's demo: 1 ms per co-executed step for its first ~350 steps, 0.32 after).
  // Elsewhere a float can decide sizes (arange's end, upsampling's scale factors) and is kept.
  // (An op with no returns, _foreach_addcdiv_.ScalarList, has no output metadata at all.)
  bool fresh_output = false;
  for (const c10::Argument& r : schema.returns()) {
    const c10::AliasInfo* info = r.alias_info();
    fresh_output = fresh_output || info == nullptr || !info->isWrite();
  }
  for (const c10::IValue& v : args) key_ivalue(key, v, fresh_output);
}

}  // namespace

const InferredOutputs& infer_outputs(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) {
  // A cache hit allocates nothing (the key lives on the stack).
  Key key;
  build_key(op, args, key);
  const uint64_t h = hash_key(key);
  const CacheEntry*& recent = t_recent[(h ^ (h >> 32)) % kRecentSlots];
  if (recent != nullptr && c10::ArrayRef<int64_t>(recent->key) == c10::ArrayRef<int64_t>(key)) return recent->outputs;
  {
    std::lock_guard<std::mutex> lock(cache_mu);
    auto it = cache.find(h);
    if (it != cache.end())
      for (const auto& entry : it->second)
        if (c10::ArrayRef<int64_t>(entry->key) == c10::ArrayRef<int64_t>(key)) {
          recent = entry.get();
          return entry->outputs;
        }
  }
  auto entry = std::make_unique<CacheEntry>(CacheEntry{std::vector<int64_t>(key.begin(), key.end()), run_on_meta(op, args)});
  std::lock_guard<std::mutex> lock(cache_mu);
  if (const LearnedLayout* real = find_entry(learned, key)) {
    if (take_layout(entry->outputs, real->outputs)) ++layouts_corrected;
  } else if (!learned_orders.empty()) {
    Key pattern;
    build_pattern(op, args, pattern);
    const LearnedOrder* order = find_entry(learned_orders, pattern);
    if (order != nullptr && take_order(entry->outputs, order->orders)) ++layouts_corrected;
  }
  ++cache_entries;
  recent = entry.get();
  return cache[h].emplace_back(std::move(entry))->outputs;
}

std::optional<LayoutWitness> layout_witness(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) {
  const c10::FunctionSchema& schema = op.schema();
  if (schema.returns().empty() || schema.is_mutable() || cpp_meta_function(op) != nullptr) return std::nullopt;
  for (const c10::Argument& r : schema.returns())
    if (r.alias_info() != nullptr) return std::nullopt;
  Key key, pattern;
  build_key(op, args, key);
  {
    std::lock_guard<std::mutex> lock(cache_mu);
    if (find_entry(learned, key) != nullptr) return std::nullopt;  // (each traced iteration asks again)
  }
  build_pattern(op, args, pattern);
  return LayoutWitness{std::vector<int64_t>(key.begin(), key.end()), std::vector<int64_t>(pattern.begin(), pattern.end())};
}

void learn_layouts(const LayoutWitness& witness, c10::ArrayRef<at::Tensor> outputs) {
  std::vector<TensorMeta> real;
  std::vector<c10::SmallVector<int64_t, 6>> orders;
  real.reserve(outputs.size());
  for (const at::Tensor& t : outputs) {
    real.push_back(t.defined() ? meta_of(t) : TensorMeta{});
    orders.push_back(t.defined() ? dim_order(t.sizes(), t.strides(), true) : c10::SmallVector<int64_t, 6>{});
  }
  const uint64_t h = hash_key(witness.key);
  std::lock_guard<std::mutex> lock(cache_mu);
  if (find_entry(learned, witness.key) != nullptr) return;
  const uint64_t hp = hash_key(witness.pattern);
  if (find_entry(learned_orders, witness.pattern) == nullptr)
    learned_orders[hp].push_back(LearnedOrder{witness.pattern, std::move(orders)});
  // An entry made before (a placeholder iteration came first): corrected in place.
  if (auto it = cache.find(h); it != cache.end())
    for (const auto& entry : it->second)
      if (entry->key == witness.key && take_layout(entry->outputs, real)) ++layouts_corrected;
  learned[h].push_back(LearnedLayout{witness.key, std::move(real)});
}

size_t shape_cache_size() { return shape_cache_counts().entries; }

ShapeCacheCounts shape_cache_counts() {
  ShapeCacheCounts c;
  c.cpp_meta = cpp_meta_calls.load(std::memory_order_relaxed);
  c.dispatched = dispatched_calls.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(cache_mu);
  c.entries = cache_entries;
  c.corrected = layouts_corrected;
  return c;
}

}  // namespace terra::capture
