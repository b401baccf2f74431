// Label strings of the engine's enums and the phase lookup.
#include "core/engine/types.h"

#include "absl/strings/str_cat.h"

namespace wpub::engine {

const char* PublicationStatusName(PublicationStatus status) {
  switch (status) {
    case PublicationStatus::kCommitted:
      return "committed";
    case PublicationStatus::kAborted:
      return "aborted";
    case PublicationStatus::kFailed:
      return "failed";
  }
  return "unknown";
}

const char* PublicationStateName(PublicationState state) {
  switch (state) {
    case PublicationState::kOpen:
      return "open";
    case PublicationState::kStaged:
      return "staged";
    case PublicationState::kCommitted:
      return "committed";
    case PublicationState::kAborted:
      return "aborted";
  }
  return "unknown";
}

double PhaseValue(const PhaseSeconds& s, std::string_view phase) {
  if (phase == "ingest") return s.ingest;
  if (phase == "policy") return s.policy;
  if (phase == "quantize") return s.quantize;
  if (phase == "pack") return s.pack;
  if (phase == "transfer") return s.transfer;
  if (phase == "commit") return s.commit;
  if (phase == "group") return s.group;
  return 0;
}

const char* ReplayKindName(ReplayKind kind) {
  return kind == ReplayKind::kCatchUp ? "catch_up" : "restore";
}

}  // namespace wpub::engine
