// End-to-end harness for the daemon tests: runs the BUILT wpubd and wpub-recv binaries as child
// processes (paths compiled in by CMake), on loopback ports wpubd picks itself, with logs and
// the receivers' safetensors files in a per-test temporary directory; plus helpers to build
// publications of a small synthetic MoE, scrape metrics over HTTP and call the health service.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "clients/recv/safetensors.h"
#include "core/policy/settings.h"
#include "core/synthetic/synthetic.h"
#include "server/client/child_process.h"
#include "server/client/publisher_client.h"
#include "wpub/v1/publisher.pb.h"

namespace wpub::testing {

struct HarnessOptions {
  int receivers = 2;
  std::vector<std::string> daemon_flags;             // extra wpubd flags
  std::vector<std::vector<std::string>> recv_flags;  // extra flags per receiver index
  // When set: the daemon and every receiver get --auth_token_file, the client its token.
  std::string auth_token_file;
};

// The wpubd binary the tests run: the build's, or $WPUB_TEST_WPUBD when set (to run the same
// tests against another build of the daemon, e.g. to show a test fails without a fix;
// $WPUB_TEST_WPUBD_ARGS, space-separated, is then added to the harness's daemon flags, e.g.
// --undefok=<flags that build lacks>).
std::string WpubdPath();

class DaemonHarness {
 public:
  static absl::StatusOr<std::unique_ptr<DaemonHarness>> Start(const HarnessOptions& options);
  // Stops everything (receivers, then wpubd); prints the logs when the test failed.
  ~DaemonHarness();

  const std::string& target() const { return target_; }
  int metrics_port() const { return ports_.metrics_port; }
  const std::string& dir() const { return dir_; }
  client::PublisherClient& client() { return *client_; }
  client::ChildProcess& daemon() { return *daemon_; }
  client::ChildProcess& receiver(int i) { return *receivers_[i]; }
  std::string recv_output(int i) const;
  std::string ReadLog(const std::string& name) const;  // "wpubd", "recv-0", ...

  // (Re)starts receiver `i` with its flags plus `extra`.
  absl::Status StartReceiver(int i, const std::vector<std::string>& extra = {});
  // Waits until GetStatus lists exactly `n` receivers.
  absl::Status WaitForReceivers(int n, absl::Duration timeout = absl::Seconds(20));
  // Waits until every listed receiver reports last_committed_version == `version`.
  absl::Status WaitForReceiversAt(uint64_t version, absl::Duration timeout = absl::Seconds(20));

 private:
  DaemonHarness() = default;
  HarnessOptions options_;
  std::string dir_;
  std::string target_;
  client::DaemonPorts ports_;
  std::unique_ptr<client::ChildProcess> daemon_;
  std::vector<std::unique_ptr<client::ChildProcess>> receivers_;
  std::unique_ptr<client::PublisherClient> client_;
};

// Waits until the receiver's safetensors file holds `version` (receivers apply a commit after
// the daemon announced it, so the trainer's report can arrive first).
absl::StatusOr<recv::SafetensorsFile> WaitForFileVersion(
    const std::string& path, uint64_t version, absl::Duration timeout = absl::Seconds(20));

// NVFP4 settings with a few ignore rules (one routed expert ignored, attention ignored).
policy::PolicySettings TestSettings();

// The header for `settings` (recipe name, quantization config JSON, precision exceptions).
wpub::v1::PublicationHeader MakeHeader(const policy::PolicySettings& settings, uint64_t version,
                                       const std::string& recipe_override = "");

// Prometheus text -> {"name{labels}": value} (labels as printed by prometheus-cpp).
absl::StatusOr<std::map<std::string, double>> ScrapeMetrics(int port);

// grpc.health.v1.Health/Check for `service` ("" = the whole server): the ServingStatus number
// (1 SERVING, 2 NOT_SERVING), or the RPC's error.
absl::StatusOr<int> HealthCheck(const std::string& target, const std::string& service = "");

}  // namespace wpub::testing
