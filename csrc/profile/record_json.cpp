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

json config_to_json(const EngineConfig& c) {
  // Knobs as [type, value] pairs: compact, and their order (sorted by type) is part of the bytes.
  json knobs = json::array();
  for (const Knob& k : c.knobs) knobs.push_back(json::array({k.type, k.value}));
  return json{{"engine", c.engine},
              {"knobs", std::move(knobs)},
              {"tag", c.tag},
              {"numerical_notes", c.numerical_notes},
              {"time_ms", c.time_ms},
              {"workspace_bytes", c.workspace_bytes}};
}

json entry_to_json(const Entry& entry) {
  json configs = json::array();
  for (const EngineConfig& c : entry.configs) configs.push_back(config_to_json(c));
  return json{{"id", entry.key.id()},
              {"key", key_to_json(entry.key)},
              {"profiled_batch", entry.profiled_batch},
              {"configs", std::move(configs)},
              {"least_memory", config_to_json(entry.least_memory)}};
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

EngineConfig config_from_json(const json& j) {
  EngineConfig c;
  c.engine = read_int(j, "engine");
  if (c.engine < 0) fail("'engine' is negative");
  const json& knobs = field(j, "knobs");
  if (!knobs.is_array()) fail("'knobs' is not a list");
  for (const json& k : knobs) {
    if (!k.is_array() || k.size() != 2 || !k[0].is_number_integer() || !k[1].is_number_integer())
      fail("a knob is not an [type, value] pair of integers");
    c.knobs.push_back(Knob{k[0].get<int64_t>(), k[1].get<int64_t>()});
  }
  // Sorted and unique by type, as written: a hand edit that breaks this would make two spellings
  // of one configuration, and same_config() compares the lists.
  for (size_t i = 1; i < c.knobs.size(); ++i)
    if (c.knobs[i - 1].type >= c.knobs[i].type) fail("'knobs' are not sorted by type, or repeat one");
  c.tag = read_string(j, "tag");
  const json& notes = field(j, "numerical_notes");
  if (!notes.is_array()) fail("'numerical_notes' is not a list");
  for (const json& n : notes) {
    if (!n.is_string()) fail("'numerical_notes' holds a non-string");
    c.numerical_notes.push_back(n.get<std::string>());
  }
  const json& time = field(j, "time_ms");
  if (!time.is_number() || !std::isfinite(time.get<double>()) || time.get<double>() < 0)
    fail("'time_ms' is not a non-negative number");
  c.time_ms = time.get<double>();
  int64_t workspace = read_int(j, "workspace_bytes");
  if (workspace < 0) fail("'workspace_bytes' is negative");
  c.workspace_bytes = static_cast<uint64_t>(workspace);
  return c;
}

Entry entry_from_json(const json& j) {
  Entry entry;
  entry.key = key_from_json(field(j, "key"));
  entry.profiled_batch = read_int(j, "profiled_batch");
  if (entry.profiled_batch < 1) fail("'profiled_batch' must be >= 1");
  const json& configs = field(j, "configs");
  if (!configs.is_array() || configs.empty()) fail("'configs' is not a non-empty list");
  for (const json& c : configs) entry.configs.push_back(config_from_json(c));
  entry.least_memory = config_from_json(field(j, "least_memory"));
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
    if (version == kLegacyFormatVersion) {
      out.status = DecodeStatus::outdated;
      size_t count = doc.contains("entries") && doc["entries"].is_array() ? doc["entries"].size() : 0;
      out.problems.push_back("format version 1 (legacy cuDNN algorithm numbers, " + std::to_string(count) +
                             " entries), which this build (format " + std::to_string(kFormatVersion) +
                             ", engine configurations) does not replay");
      return out;
    }
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
