#include "capture/trace_json.h"

#include "capture/draw_side.h"
#include "capture/interceptor.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/UndefinedTensorImpl.h>

#include <cstring>
#include <stdexcept>
#include <string>

namespace terra::capture {

using nlohmann::json;

namespace {

// No user-space address has the top bit set: a token read back can never equal a live
// TensorImpl's address, so it never names an object of this process by accident.
constexpr uint64_t kTokenBit = uint64_t(1) << 63;

int64_t bits_of(double d) {
  int64_t b;
  std::memcpy(&b, &d, sizeof b);
  return b;
}

double double_of(int64_t b) {
  double d;
  std::memcpy(&d, &b, sizeof d);
  return d;
}

[[noreturn]] void refuse(const std::string& what) { throw std::invalid_argument("terra_torch: " + what); }

// Host bookkeeping ops (no tensor in or out: the profiler's record_function pair around
// optimizer.step()) always run in Python and never in the graph (emit/graph_emitter.cpp), so
// their arguments' values are never used again: an object among them (the profiler's handle)
// is written as an opaque mark and read back as None. Their hash, kept as written, still says
// what kind of argument it was.
bool is_host_record(const OpRecord& rec) {
  if (!rec.inputs.empty()) return false;
  for (const c10::Argument& ret : rec.op.schema().returns())
    if (type_contains_tensor(ret.type())) return false;
  return true;
}

json attribute_to_json(const c10::IValue& v, const std::string& op, bool opaque_ok) {
  if (v.isNone()) return nullptr;
  if (v.isBool()) return {{"b", v.toBool()}};
  if (v.isInt()) return {{"i", v.toInt()}};
  if (v.isDouble()) return {{"f", bits_of(v.toDouble())}};
  if (v.isString()) return {{"s", v.toStringRef()}};
  if (v.isDevice()) return {{"d", {static_cast<int>(v.toDevice().type()), v.toDevice().index()}}};
  if (v.isComplexDouble()) {
    const c10::complex<double> c = v.toComplexDouble();
    return {{"c", {bits_of(c.real()), bits_of(c.imag())}}};
  }
  if (v.isIntList()) return {{"il", v.toIntVector()}};
  if (v.isDoubleList()) {
    json out = json::array();
    for (const double d : v.toDoubleVector()) out.push_back(bits_of(d));
    return {{"fl", out}};
  }
  if (v.isBoolList()) {
    json out = json::array();
    for (const c10::IValue& e : v.toListRef()) out.push_back(e.toBool());
    return {{"bl", out}};
  }
  if (v.isList()) {
    // int?[] and the like: elements one by one, with the list's element type by name.
    const c10::TypePtr element = v.toList().elementType();
    json out = json::array();
    for (const c10::IValue& e : v.toListRef()) out.push_back(attribute_to_json(e, op, opaque_ok));
    return {{"l", out}, {"t", element->annotation_str()}};
  }
  if (opaque_ok) return {{"o", v.tagKind()}};
  refuse("an argument of kind " + std::string(v.tagKind()) + " of " + op + " cannot be kept across runs");
}

c10::TypePtr list_element_type(const std::string& name) {
  if (name == "int") return c10::IntType::get();
  if (name == "float") return c10::FloatType::get();
  if (name == "bool") return c10::BoolType::get();
  if (name == "SymInt") return c10::SymIntType::get();
  if (name == "Optional[int]") return c10::OptionalType::create(c10::IntType::get());
  if (name == "Optional[float]") return c10::OptionalType::create(c10::FloatType::get());
  if (name == "Optional[SymInt]") return c10::OptionalType::create(c10::SymIntType::get());
  refuse("a list of " + name + " cannot be read back");
}

c10::IValue attribute_from_json(const json& j) {
  if (j.is_null()) return c10::IValue();
  if (!j.is_object() || j.empty()) refuse("a malformed attribute");
  if (j.contains("b")) return c10::IValue(j.at("b").get<bool>());
  if (j.contains("i")) return c10::IValue(j.at("i").get<int64_t>());
  if (j.contains("f")) return c10::IValue(double_of(j.at("f").get<int64_t>()));
  if (j.contains("s")) return c10::IValue(j.at("s").get<std::string>());
  if (j.contains("d")) {
    const auto& d = j.at("d");
    return c10::IValue(c10::Device(static_cast<c10::DeviceType>(d.at(0).get<int>()), static_cast<c10::DeviceIndex>(d.at(1).get<int>())));
  }
  if (j.contains("c")) {
    const auto& c = j.at("c");
    return c10::IValue(c10::complex<double>(double_of(c.at(0).get<int64_t>()), double_of(c.at(1).get<int64_t>())));
  }
  if (j.contains("il")) return c10::IValue(j.at("il").get<std::vector<int64_t>>());
  if (j.contains("fl")) {
    std::vector<double> out;
    for (const auto& b : j.at("fl")) out.push_back(double_of(b.get<int64_t>()));
    return c10::IValue(out);
  }
  if (j.contains("o")) return c10::IValue();  // an opaque argument of a host op (is_host_record)
  if (j.contains("bl")) {
    c10::List<bool> out;
    for (const auto& b : j.at("bl")) out.push_back(b.get<bool>());
    return c10::IValue(out);
  }
  if (j.contains("l")) {
    c10::impl::GenericList out(list_element_type(j.at("t").get<std::string>()));
    for (const auto& e : j.at("l")) out.push_back(attribute_from_json(e));
    return c10::IValue(out);
  }
  refuse("an attribute of unknown kind");
}

json meta_to_json(const TensorMeta& m) {
  return {static_cast<int>(m.dtype),
          static_cast<int>(m.device.type()),
          m.device.index(),
          std::vector<int64_t>(m.sizes.begin(), m.sizes.end()),
          std::vector<int64_t>(m.strides.begin(), m.strides.end()),
          m.storage_offset,
          m.requires_grad,
          m.conj,
          m.neg};
}

TensorMeta meta_from_json(const json& j) {
  TensorMeta m;
  m.dtype = static_cast<c10::ScalarType>(j.at(0).get<int>());
  m.device = c10::Device(static_cast<c10::DeviceType>(j.at(1).get<int>()), static_cast<c10::DeviceIndex>(j.at(2).get<int>()));
  for (const auto& s : j.at(3)) m.sizes.push_back(s.get<int64_t>());
  for (const auto& s : j.at(4)) m.strides.push_back(s.get<int64_t>());
  m.storage_offset = j.at(5).get<int64_t>();
  m.requires_grad = j.at(6).get<bool>();
  m.conj = j.size() > 7 && j.at(7).get<bool>();  // (absent in traces written before the math bits)
  m.neg = j.size() > 8 && j.at(8).get<bool>();
  return m;
}

c10::OperatorHandle find_operator(const std::string& name, const std::string& overload) {
  const std::optional<c10::OperatorHandle> op = c10::Dispatcher::singleton().findSchema({name, overload});
  if (!op) refuse("operator " + name + (overload.empty() ? "" : "." + overload) + " is not registered in this process");
  return *op;
}

}  // namespace

json trace_to_json(const Trace& trace, const std::function<uint64_t(const void*)>& token_of) {
  json ops = json::array();
  for (const OpRecord& rec : trace.ops) {
    const c10::OperatorName& name = rec.op.operator_name();
    const std::string full = name.name + (name.overload_name.empty() ? "" : "." + name.overload_name);
    json attrs = json::array();
    const bool host = is_host_record(rec);
    for (const c10::IValue& v : rec.attributes) attrs.push_back(attribute_to_json(v, full, host));
    json inputs = json::array();
    for (const OpInput& in : rec.inputs)
      inputs.push_back({in.argument, in.list_index, in.value.record, in.value.output, in.value.external});
    json outputs = json::array();
    for (const TensorMeta& m : rec.outputs) outputs.push_back(meta_to_json(m));
    json loops = json::array();
    for (const LoopFrame& f : rec.loops) loops.push_back({f.loop_id, f.iteration});
    ops.push_back({{"op", name.name},
                   {"overload", name.overload_name},
                   {"attrs", std::move(attrs)},
                   {"attr_args", std::vector<int16_t>(rec.attribute_arguments.begin(), rec.attribute_arguments.end())},
                   {"hash", rec.attributes_hash},
                   {"in", std::move(inputs)},
                   {"out", std::move(outputs)},
                   {"loc", rec.location},
                   {"loops", std::move(loops)},
                   {"bw", rec.backward},
                   {"origin", rec.origin},
                   {"mat", rec.needs_materialization},
                   {"chk", rec.checked}});
  }
  json externals = json::array();
  for (const ExternalInput& e : trace.externals) {
    const bool none = e.identity == c10::UndefinedTensorImpl::singleton();
    externals.push_back({{"meta", meta_to_json(e.meta)},
                         {"token", none || e.wrapped_number ? 0 : token_of(e.identity)},
                         {"reader", e.first_reader},
                         {"wrapped", e.wrapped_number},
                         {"none", none}});
  }
  return {{"ops", std::move(ops)}, {"externals", std::move(externals)}};
}

Trace trace_from_json(const json& j) {
  Trace trace;
  try {
    for (const json& e : j.at("externals")) {
      ExternalInput in;
      in.meta = meta_from_json(e.at("meta"));
      in.first_reader = e.at("reader").get<uint64_t>();
      in.wrapped_number = e.at("wrapped").get<bool>();
      const uint64_t token = e.at("token").get<uint64_t>();
      if (e.at("none").get<bool>()) {
        in.identity = c10::UndefinedTensorImpl::singleton();
      } else {
        // Wrapped numbers are one object per op: a token of their own each.
        const uint64_t t = in.wrapped_number ? trace.externals.size() + 1 : token;
        in.identity = reinterpret_cast<const void*>(static_cast<uintptr_t>(kTokenBit | t | (in.wrapped_number ? uint64_t(1) << 62 : 0)));
      }
      trace.externals.push_back(std::move(in));
    }
    trace.ops.reserve(j.at("ops").size());
    for (const json& o : j.at("ops")) {
      OpRecord& rec = trace.ops.emplace_back(find_operator(o.at("op").get<std::string>(), o.at("overload").get<std::string>()));
      for (const json& a : o.at("attrs")) rec.attributes.push_back(attribute_from_json(a));
      for (const json& a : o.at("attr_args")) rec.attribute_arguments.push_back(a.get<int16_t>());
      if (rec.attributes.size() != rec.attribute_arguments.size()) refuse("attributes and their positions differ in number");
      rec.attributes_hash = o.at("hash").get<uint64_t>();
      for (const json& in : o.at("in")) {
        OpInput input{in.at(0).get<int32_t>(), in.at(1).get<int32_t>(), {}};
        input.value.record = in.at(2).get<int32_t>();
        input.value.output = in.at(3).get<int32_t>();
        input.value.external = in.at(4).get<int32_t>();
        const bool external_ok = input.value.external >= 0 && static_cast<size_t>(input.value.external) < trace.externals.size();
        const bool record_ok = input.value.record >= 0 && static_cast<size_t>(input.value.record) < trace.ops.size() - 1;
        if (!(input.value.is_external() ? external_ok : record_ok)) refuse("an input refers to nothing before it");
        rec.inputs.push_back(input);
      }
      for (const json& m : o.at("out")) rec.outputs.push_back(meta_from_json(m));
      rec.location = o.at("loc").get<uint64_t>();
      for (const json& f : o.at("loops")) rec.loops.push_back({f.at(0).get<uint64_t>(), f.at(1).get<uint32_t>()});
      rec.backward = o.at("bw").get<bool>();
      rec.origin = o.at("origin").get<int32_t>();
      rec.needs_materialization = o.at("mat").get<bool>();
      rec.checked = o.at("chk").get<bool>();
      note_graph_draws(rec);  // (the graph built from it draws: capture/draw_side.h)
    }
  } catch (const json::exception& e) {
    refuse(std::string("a kept trace is malformed: ") + e.what());
  }
  return trace;
}

}  // namespace terra::capture
