// A transport of one receiver that says nothing back: every publication call but Send succeeds
// at once, with no outcomes and no receivers to list. Test fakes derive from it and override
// what they observe (capabilities, Send).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/transport/transport.h"

namespace wpub::transport::testing {

class QuietTransport : public Transport {
 public:
  explicit QuietTransport(std::string receiver) : receiver_(std::move(receiver)) {}
  absl::StatusOr<std::vector<std::string>> Begin(const PublicationManifest&) override {
    return std::vector<std::string>{receiver_};
  }
  absl::Status WaitAcknowledged(absl::Time) override { return absl::OkStatus(); }
  absl::Status Commit() override { return absl::OkStatus(); }
  void Abort(absl::string_view) override {}
  std::vector<ReceiverOutcome> Outcomes() const override { return {}; }
  std::vector<ReceiverInfo> Receivers() const override { return {}; }

 private:
  const std::string receiver_;
};

}  // namespace wpub::transport::testing
