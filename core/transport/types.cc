// Label strings of the transport's enums.
#include "core/transport/types.h"

namespace wpub::transport {

const char* ReceiverStateName(ReceiverState state) {
  switch (state) {
    case ReceiverState::kIdle:
      return "idle";
    case ReceiverState::kReceiving:
      return "receiving";
    case ReceiverState::kStaged:
      return "staged";
    case ReceiverState::kFailed:
      return "failed";
    case ReceiverState::kLeft:
      return "left";
    case ReceiverState::kDirty:
      return "dirty";
  }
  return "unknown";
}

const char* ReceiverFailureName(ReceiverFailure failure) {
  switch (failure) {
    case ReceiverFailure::kNone:
      return "none";
    case ReceiverFailure::kChecksum:
      return "checksum";
    case ReceiverFailure::kTimeout:
      return "timeout";
    case ReceiverFailure::kDisconnected:
      return "disconnected";
    case ReceiverFailure::kProtocol:
      return "protocol";
  }
  return "unknown";
}

const char* RetainWhereName(RetainWhere where) {
  switch (where) {
    case RetainWhere::kOff:
      return "off";
    case RetainWhere::kHost:
      return "host";
    case RetainWhere::kDevice:
      return "device";
    case RetainWhere::kPinned:
      return "pinned";
  }
  return "off";
}

}  // namespace wpub::transport
