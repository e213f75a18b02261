// Names of run statuses, for messages and the Python front.
#include "profile/provider.h"

namespace terra::profile {

std::string_view run_status_name(RunStatus status) {
  switch (status) {
    case RunStatus::ok: return "ok";
    case RunStatus::not_supported: return "not_supported";
    case RunStatus::out_of_memory: return "out_of_memory";
    case RunStatus::exceeds_cap: return "exceeds_cap";
    case RunStatus::failed: return "failed";
  }
  return "failed";
}

}  // namespace terra::profile
