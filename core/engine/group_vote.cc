#include "core/engine/group_vote.h"

#include "absl/strings/str_cat.h"

namespace wpub::engine {

absl::Status ValidateGroupMembership(const GroupMembership& m) {
  if (m.group.empty() || m.group.size() > 100) {
    return absl::InvalidArgumentError(
        absl::StrCat("group.group must be 1 to 100 bytes, got ", m.group.size()));
  }
  for (char c : m.group) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '-' || c == '.';
    if (!ok) {
      return absl::InvalidArgumentError(
          "group.group may hold only letters, digits, '_', '-' and '.'");
    }
  }
  if (m.members < 1 || m.members > kMaxGroupMembers) {
    return absl::InvalidArgumentError(
        absl::StrCat("group.members must be in [1, ", kMaxGroupMembers, "], got ", m.members));
  }
  if (m.member >= m.members) {
    return absl::InvalidArgumentError(
        absl::StrCat("group.member ", m.member, " must be below group.members ", m.members));
  }
  if (m.member > 0 && m.leader.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("group.leader (the leader's address) is required for member ", m.member));
  }
  if (m.leader.size() > 256) {
    return absl::InvalidArgumentError("group.leader is longer than 256 bytes");
  }
  if (m.publisher.size() > 256) {
    return absl::InvalidArgumentError("group.publisher is longer than 256 bytes");
  }
  if (m.timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("group.timeout must not be negative");
  }
  return absl::OkStatus();
}

}  // namespace wpub::engine
