// JSON encoding of records with nlohmann/json; see record_json.h for the rules.
#include "profile/record_json.h"

#include <algorithm>
#include <cmath>
#include <map>

#include <nlohmann/json.hpp>

namespace terra::profile {

namespace {

using nlohmann::json;

json key_to_json(const ConvKey& key) {
  return json{{"role", std::string(role_name(key.role))},
              {"input", key.input},
              {"filter", key.filter},
              {"output", key.output},
              {"padding", key.padding},
              {"stride", key.stride},
              {"dilation", key.dilation},
              {"groups", key.groups},
              {"dtype", key.dtype},
              {"compute_type", key.compute_type},
              {"layout", key.layout},
              {"math_mode", key.math_mode},
              {"deterministic", key.deterministic}};
}

json perf_to_json(const AlgoPerf& perf) {
  return json{{"algo", perf.algo},
              {"math_type", perf.math_type},
              {"name", perf.name},
              {"time_ms", perf.time_ms},
              {"workspace_bytes", perf.workspace_bytes}};
}

json entry_to_json(const Entry& entry) {
  json algorithms = json::array();
  for (const AlgoPerf& perf : entry.algorithms) algorithms.push_back(perf_to_json(perf));
  return json{{"id", entry.key.id()},
              {"key", key_to_json(entry.key)},
              {"profiled_batch", entry.profiled_batch},
              {"algorithms", std::move(algorithms)},
              {"least_memory", perf_to_json(entry.least_memory)}};
}

// The readers below throw std::runtime_error (or json's own exceptions) with a sentence; the
// caller turns that into a problem report for one entry.
[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

const json& field(const json& object, const char* name) {
  if (!object.is_object() || !object.contains(name)) fail(std::string("missing field '") + name + "'");
  return object.at(name);
}

int64_t read_int(const json& object, const char* name) {
  const json& value = field(object, name);
  if (!value.is_number_integer()) fail(std::string("'") + name + "' is not an integer");
  return value.get<int64_t>();
}

std::string read_string(const json& object, const char* name) {
  const json& value = field(object, name);
  if (!value.is_string()) fail(std::string("'") + name + "' is not a string");
  return value.get<std::string>();
}

Dims read_dims(const json& object, const char* name) {
  const json& value = field(object, name);
  if (!value.is_array()) fail(std::string("'") + name + "' is not a list");
  Dims dims;
  for (const json& d : value) {
    if (!d.is_number_integer()) fail(std::string("'") + name + "' holds a non-integer");
    dims.push_back(d.get<int64_t>());
  }
  return dims;
}

ConvKey key_from_json(const json& j) {
  ConvKey key;
  auto role = parse_role(read_string(j, "role"));
  if (!role) fail("unknown role '" + read_string(j, "role") + "'");
  key.role = *role;
  key.input = read_dims(j, "input");
  key.filter = read_dims(j, "filter");
  key.output = read_dims(j, "output");
  key.padding = read_dims(j, "padding");
  key.stride = read_dims(j, "stride");
  key.dilation = read_dims(j, "dilation");
  key.groups = read_int(j, "groups");
  key.dtype = read_string(j, "dtype");
  key.compute_type = read_string(j, "compute_type");
  key.layout = read_string(j, "layout");
  key.math_mode = read_string(j, "math_mode");
  const json& det = field(j, "deterministic");
  if (!det.is_boolean()) fail("'deterministic' is not true/false");
  key.deterministic = det.get<bool>();
  if (std::string why = key.invalid_reason(); !why.empty()) fail("invalid key: " + why);
  return key;
}

AlgoPerf perf_from_json(const json& j) {
  AlgoPerf perf;
  perf.algo = static_cast<int>(read_int(j, "algo"));
  perf.math_type = static_cast<int>(read_int(j, "math_type"));
  perf.name = read_string(j, "name");
  const json& time = field(j, "time_ms");
  if (!time.is_number() || !std::isfinite(time.get<double>()) || time.get<double>() < 0)
    fail("'time_ms' is not a non-negative number");
  perf.time_ms = time.get<double>();
  int64_t workspace = read_int(j, "workspace_bytes");
  if (workspace < 0) fail("'workspace_bytes' is negative");
  perf.workspace_bytes = static_cast<uint64_t>(workspace);
  return perf;
}

Entry entry_from_json(const json& j) {
  Entry entry;
  entry.key = key_from_json(field(j, "key"));
  entry.profiled_batch = read_int(j, "profiled_batch");
  if (entry.profiled_batch < 1) fail("'profiled_batch' must be >= 1");
  const json& algorithms = field(j, "algorithms");
  if (!algorithms.is_array() || algorithms.empty()) fail("'algorithms' is not a non-empty list");
  for (const json& a : algorithms) entry.algorithms.push_back(perf_from_json(a));
  entry.least_memory = perf_from_json(field(j, "least_memory"));
  return entry;
}

RecordHeader header_from_json(const json& j) {
  RecordHeader header;
  header.format_version = static_cast<int>(read_int(j, "format_version"));
  header.device_name = read_string(j, "device_name");
  header.compute_capability = read_string(j, "compute_capability");
  header.cudnn_version = read_int(j, "cudnn_version");
  header.cuda_version = read_int(j, "cuda_version");
  header.torch_version = read_string(j, "torch_version");
  return header;
}

}  // namespace

std::string encode(const Record& record) {
  std::vector<const Entry*> sorted;
  for (const Entry& e : record.entries) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(),
            [](const Entry* a, const Entry* b) { return a->key.id() < b->key.id(); });
  const RecordHeader& h = record.header;
  json header{{"format_version", h.format_version},
              {"device_name", h.device_name},
              {"compute_capability", h.compute_capability},
              {"cudnn_version", h.cudnn_version},
              {"cuda_version", h.cuda_version},
              {"torch_version", h.torch_version}};
  // One entry per line: diffs of a record show which convolutions changed, and it stays readable
  // with hundreds of entries. Object keys are sorted by nlohmann's std::map-backed json.
  std::string out = "{\n \"format\": " + json(kFormatName).dump() + ",\n \"header\": " + header.dump() +
                    ",\n \"entries\": [";
  for (size_t i = 0; i < sorted.size(); ++i) out += (i ? ",\n  " : "\n  ") + entry_to_json(*sorted[i]).dump();
  out += sorted.empty() ? "]\n}\n" : "\n ]\n}\n";
  return out;
}

Decoded decode(std::string_view text) {
  Decoded out;
  json doc = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    out.problems.push_back("not valid JSON");
    return out;
  }
  if (!doc.is_object() || !doc.contains("format") || doc["format"] != kFormatName) {
    out.problems.push_back(std::string("not a profile record (no \"format\": \"") + kFormatName + "\")");
    return out;
  }
  try {
    const json& header = field(doc, "header");
    int64_t version = read_int(header, "format_version");
    if (version != kFormatVersion) {
      out.status = DecodeStatus::incompatible;
      out.problems.push_back("format version " + std::to_string(version) + ", this build reads " +
                             std::to_string(kFormatVersion));
      return out;
    }
    out.record.header = header_from_json(header);
  } catch (const std::exception& e) {
    out.problems.push_back(std::string("bad header: ") + e.what());
    return out;
  }
  const json* entries = doc.contains("entries") ? &doc["entries"] : nullptr;
  if (!entries || !entries->is_array()) {
    out.problems.push_back("'entries' is not a list");
    return out;
  }
  std::map<std::string, size_t> seen;  // id -> position, to drop duplicates
  for (size_t i = 0; i < entries->size(); ++i) {
    try {
      Entry entry = entry_from_json((*entries)[i]);
      std::string id = entry.key.id();
      if (seen.count(id)) {
        out.problems.push_back("entry " + std::to_string(i) + " repeats key '" + id + "'; first kept");
        continue;
      }
      seen[id] = i;
      out.record.entries.push_back(std::move(entry));
    } catch (const std::exception& e) {
      out.problems.push_back("entry " + std::to_string(i) + " dropped: " + e.what());
    }
  }
  out.status = DecodeStatus::ok;
  return out;
}

}  // namespace terra::profile
