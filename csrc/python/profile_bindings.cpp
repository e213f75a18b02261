// Python bindings of the profile record (csrc/profile), filling terra_torch._C.profile. Includes
// pybind11 only, no torch header, so this TU compiles in seconds. Keys, headers and outcomes cross
// as plain dicts and entries as canonical JSON text: terra_torch/profile.py turns them into
// dataclasses, and the file format has exactly one implementation (record_json.cpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "profile/active.h"
#include "profile/conv_call.h"
#include "profile/fake_provider.h"
#include "profile/record_json.h"
#include "profile/selector.h"
#if TERRA_WITH_CUDA
#include "profile/cuda_hooks.h"
#endif

#include "python/bindings.h"

namespace terra::python {

namespace py = pybind11;
using namespace terra::profile;

namespace {

template <typename T>
T get(const py::dict& d, const char* name) {
  if (!d.contains(name)) throw py::key_error(std::string("missing '") + name + "'");
  return d[name].cast<T>();
}

template <typename T>
T get_or(const py::dict& d, const char* name, T fallback) {
  return d.contains(name) ? d[name].cast<T>() : fallback;
}

ConvKey key_from_dict(const py::dict& d) {
  ConvKey key;
  auto role = parse_role(get<std::string>(d, "role"));
  if (!role) throw py::value_error("unknown role '" + get<std::string>(d, "role") + "'");
  key.role = *role;
  key.input = get<Dims>(d, "input");
  key.filter = get<Dims>(d, "filter");
  key.output = get<Dims>(d, "output");
  key.padding = get<Dims>(d, "padding");
  key.stride = get<Dims>(d, "stride");
  key.dilation = get<Dims>(d, "dilation");
  key.groups = get<int64_t>(d, "groups");
  key.dtype = get<std::string>(d, "dtype");
  key.compute_type = get<std::string>(d, "compute_type");
  key.layout = get<std::string>(d, "layout");
  key.math_mode = get<std::string>(d, "math_mode");
  key.deterministic = get<bool>(d, "deterministic");
  if (std::string why = key.invalid_reason(); !why.empty()) throw py::value_error("invalid key: " + why);
  return key;
}

py::dict key_to_dict(const ConvKey& key) {
  py::dict d;
  d["role"] = std::string(role_name(key.role));
  d["input"] = key.input;
  d["filter"] = key.filter;
  d["output"] = key.output;
  d["padding"] = key.padding;
  d["stride"] = key.stride;
  d["dilation"] = key.dilation;
  d["groups"] = key.groups;
  d["dtype"] = key.dtype;
  d["compute_type"] = key.compute_type;
  d["layout"] = key.layout;
  d["math_mode"] = key.math_mode;
  d["deterministic"] = key.deterministic;
  return d;
}

ConvCall call_from_dict(const py::dict& d) {
  ConvCall call;
  call.input = get<Dims>(d, "input");
  call.weight = get<Dims>(d, "weight");
  call.output = get<Dims>(d, "output");
  call.padding = get<Dims>(d, "padding");
  call.stride = get<Dims>(d, "stride");
  call.dilation = get<Dims>(d, "dilation");
  call.groups = get<int64_t>(d, "groups");
  call.transposed = get_or<bool>(d, "transposed", false);
  call.dtype = get<std::string>(d, "dtype");
  call.layout = get<std::string>(d, "layout");
  call.allow_tf32 = get_or<bool>(d, "allow_tf32", true);
  call.deterministic = get_or<bool>(d, "deterministic", false);
  return call;
}

Pass parse_pass(const std::string& name) {
  if (name == "forward") return Pass::forward;
  if (name == "grad_input") return Pass::grad_input;
  if (name == "grad_weight") return Pass::grad_weight;
  throw py::value_error("pass must be forward, grad_input or grad_weight, not '" + name + "'");
}

RecordHeader header_from_dict(const py::dict& d) {
  RecordHeader h;
  h.device_name = get<std::string>(d, "device_name");
  h.compute_capability = get<std::string>(d, "compute_capability");
  h.cudnn_version = get<int64_t>(d, "cudnn_version");
  h.cuda_version = get<int64_t>(d, "cuda_version");
  h.torch_version = get<std::string>(d, "torch_version");
  return h;
}

py::dict header_to_dict(const RecordHeader& h) {
  py::dict d;
  d["format_version"] = h.format_version;
  d["device_name"] = h.device_name;
  d["compute_capability"] = h.compute_capability;
  d["cudnn_version"] = h.cudnn_version;
  d["cuda_version"] = h.cuda_version;
  d["torch_version"] = h.torch_version;
  return d;
}

py::list diagnostics_to_list(const Diagnostics& ds) {
  py::list out;
  for (const Diagnostic& d : ds)
    out.append(py::make_tuple(d.level == Diagnostic::Level::warning ? "warning"
                              : d.level == Diagnostic::Level::info  ? "info"
                                                                    : "debug",
                              d.message));
  return out;
}

py::dict config_to_dict(const EngineConfig& c) {
  py::dict d;
  d["engine"] = c.engine;
  py::list knobs;
  for (const Knob& k : c.knobs) knobs.append(py::make_tuple(k.type, k.value));
  d["knobs"] = knobs;
  d["tag"] = c.tag;
  d["numerical_notes"] = c.numerical_notes;
  d["time_ms"] = c.time_ms;
  d["workspace_bytes"] = c.workspace_bytes;
  return d;
}

RunStatus parse_status(const std::string& name) {
  for (RunStatus s : {RunStatus::ok, RunStatus::not_supported, RunStatus::out_of_memory,
                      RunStatus::exceeds_cap, RunStatus::failed})
    if (run_status_name(s) == name) return s;
  throw py::value_error("unknown run status '" + name + "'");
}

std::vector<FakeAlgo> fake_algos_from(const py::list& algos) {
  std::vector<FakeAlgo> out;
  for (const py::handle& item : algos) {
    py::dict d = item.cast<py::dict>();
    FakeAlgo a;
    a.engine = get<int64_t>(d, "engine");
    a.name = get_or<std::string>(d, "name", "fake" + std::to_string(a.engine));
    a.time_ms_per_sample = get_or<double>(d, "time_ms_per_sample", 1.0);
    a.workspace_per_sample = get_or<uint64_t>(d, "workspace_per_sample", 0);
    a.run_status = parse_status(get_or<std::string>(d, "run_status", "ok"));
    a.unsupported_from_batch = get_or<int64_t>(d, "unsupported_from_batch", 0);
    a.in_heuristics = get_or<bool>(d, "in_heuristics", true);
    a.in_profile = get_or<bool>(d, "in_profile", true);
    out.push_back(std::move(a));
  }
  return out;
}

py::dict outcome_to_dict(const Outcome& o) {
  py::dict d;
  d["ok"] = o.ok;
  d["config"] = o.ok && o.config ? py::object(config_to_dict(*o.config)) : py::object(py::none());
  d["source"] = std::string(source_name(o.source));
  d["fell_back"] = o.fell_back;
  py::list failed;
  for (const auto& [algo, status] : o.failed) failed.append(py::make_tuple(algo.engine, std::string(run_status_name(status))));
  d["failed"] = failed;
  d["error"] = o.error;
  return d;
}

py::dict stats_to_dict(const SelectorStats& s) {
  py::dict d;
  d["calls"] = s.calls;
  d["plan_hits"] = s.plan_hits;
  d["plan_builds"] = s.plan_builds;
  d["record_hits"] = s.record_hits;
  d["profiles"] = s.profiles;
  d["heuristic_runs"] = s.heuristic_runs;
  d["fallbacks"] = s.fallbacks;
  d["failures"] = s.failures;
  return d;
}

py::dict decode_to_dict(const std::string& text) {
  Decoded decoded = decode(text);
  py::dict d;
  d["status"] = decoded.status == DecodeStatus::ok             ? "ok"
                : decoded.status == DecodeStatus::outdated     ? "outdated"
                : decoded.status == DecodeStatus::incompatible ? "incompatible"
                                                               : "corrupt";
  d["problems"] = decoded.problems;
  d["canonical"] = decoded.status == DecodeStatus::ok ? encode(decoded.record) : std::string();
  return d;
}

void bind_fake_provider(py::module_& m) {
  py::class_<FakeProvider>(m, "FakeProvider",
                           "Scripted convolution provider for tests (see csrc/profile/fake_provider.h)")
      .def(py::init([](std::optional<py::list> algos) {
             return FakeProvider(algos ? fake_algos_from(*algos) : std::vector<FakeAlgo>{});
           }),
           py::arg("algos") = py::none())
      .def("script", [](FakeProvider& f, const std::string& key_id, const py::list& algos) {
             f.script(key_id, fake_algos_from(algos));
           })
      .def("set_run_status", [](FakeProvider& f, int64_t engine, const std::string& status) {
             f.set_run_status(engine, parse_status(status));
           })
      .def_property_readonly("profile_calls", &FakeProvider::profile_calls)
      .def_property_readonly("heuristics_calls", &FakeProvider::heuristics_calls)
      .def_property_readonly("build_calls", &FakeProvider::build_calls)
      .def_property_readonly("execute_calls", &FakeProvider::execute_calls)
      .def_property_readonly("successful_runs", &FakeProvider::successful_runs)
      .def_property_readonly("attempted", &FakeProvider::attempted)
      .def_property_readonly("built", &FakeProvider::built)
      .def_property_readonly("profiled_keys", &FakeProvider::profiled_keys);
}

void bind_selector(py::module_& m) {
  py::class_<Selector, std::shared_ptr<Selector>>(m, "Selector",
                                                  "Record lookup / profiling / fallback policy (csrc/profile/selector.h)")
      .def(py::init([](const std::string& path, const py::dict& header, std::optional<uint64_t> cap,
                       bool save_each_profile) {
             return std::make_shared<Selector>(RecordStore(path, header_from_dict(header)),
                                               SelectorOptions{cap, save_each_profile});
           }),
           py::arg("path"), py::arg("header"), py::arg("workspace_cap") = py::none(),
           py::arg("save_each_profile") = true)
      .def("load", [](Selector& s) { return diagnostics_to_list(s.load()); })
      .def("flush", [](Selector& s) { return diagnostics_to_list(s.flush()); })
      .def("drain", [](Selector& s) { return diagnostics_to_list(s.drain()); })
      .def("run", [](Selector& s, const py::dict& key, int64_t batch, FakeProvider& provider) {
             return outcome_to_dict(s.run(key_from_dict(key), batch, provider));
           })
      .def("stats", [](const Selector& s) { return stats_to_dict(s.stats()); })
      .def("entries_json", [](const Selector& s) { return encode(Record{s.header(), s.entries()}); })
      .def_property_readonly("path", &Selector::path)
      .def_property_readonly("header", [](const Selector& s) { return header_to_dict(s.header()); })
      .def_property_readonly("workspace_cap", [](const Selector& s) { return s.workspace_cap(); });
}

void bind_cuda(py::module_& m) {
#if TERRA_WITH_CUDA
  m.attr("with_cuda") = true;
  m.def("cuda_device_header", [](int index) { return header_to_dict(cuda::device_header(index)); });
  m.def("install_cuda_kernels", &cuda::install_kernels);
  m.def("uninstall_cuda_kernels", &cuda::uninstall_kernels);
  m.def("cuda_kernels_installed", &cuda::kernels_installed);
#else
  m.attr("with_cuda") = false;
#endif
}

}  // namespace

void init_profile(pybind11::module_& parent) {
  py::module_ m = parent.def_submodule("profile", "convolution profile records");
  m.attr("format_version") = kFormatVersion;
  m.def("make_key", [](const py::dict& call, const std::string& pass) {
        KeyedCall kc = make_key(call_from_dict(call), parse_pass(pass));
        return py::make_tuple(key_to_dict(kc.key), kc.batch);
      }, py::arg("call"), py::arg("pass_") = "forward",
      "Record key and batch size of a framework convolution call (dict of shapes and attributes)");
  m.def("key_id", [](const py::dict& key) { return key_from_dict(key).id(); });
  m.def("decode_record", &decode_to_dict, "Validates record text: status, problems, canonical text");
  m.def("set_active", [](std::shared_ptr<Selector> s) { set_active_selector(std::move(s)); },
        py::arg("selector").none(true));
  m.def("active", []() { return active_selector(); });
  bind_fake_provider(m);
  bind_selector(m);
  bind_cuda(m);
}

}  // namespace terra::python
