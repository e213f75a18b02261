// The on-disk form of a record. Encoding is canonical (entries sorted by key id, one per line,
// object keys sorted) so that the same content always gives the same bytes: a record can
// be diffed, checked in, and compared by hash. Decoding treats the file as untrusted input: it
// never throws, it reports.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "profile/entry.h"
#include "profile/record_header.h"

namespace terra::profile {

struct Record {
  RecordHeader header;
  std::vector<Entry> entries;
};

std::string encode(const Record& record);

enum class DecodeStatus {
  ok,            // header usable; bad entries (if any) were dropped and named in `problems`
  corrupt,       // not JSON, or not a record at all
  outdated,      // format 1 (legacy algorithm enums): readable, but nothing in it can be replayed
  incompatible,  // a record of another (unknown) format version
};

struct Decoded {
  DecodeStatus status = DecodeStatus::corrupt;
  Record record;                      // meaningful when status == ok
  std::vector<std::string> problems;  // one sentence each
};

Decoded decode(std::string_view text);

}  // namespace terra::profile
