// The C++ trainer-side client of wpubd's Publisher API: streams one publication (header, one
// message per conversion batch, inline payload chunks or shared-memory references, commit) and
// returns the daemon's report. Used by `wpubctl publish-synthetic` / `demo`, the daemon's
// end-to-end tests and the ingestion benchmark. (Python trainers use clients/python.)
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/common/tensor.h"
#include "core/synthetic/synthetic.h"
#include "wire/tls.h"
#include "wpub/v1/publisher.grpc.pb.h"

namespace wpub::client {

struct ClientOptions {
  std::string target = "127.0.0.1:50151";
  std::string auth_token;  // sent as `authorization: Bearer <token>` when non-empty
  absl::Duration connect_timeout = absl::Seconds(10);
  // true: a connection that fails (refused, a name that does not resolve) is UNAVAILABLE at once,
  // naming the target and what to check, instead of being retried until connect_timeout -- what
  // a command-line tool wants. false: wait up to connect_timeout for a daemon that is starting
  // (a long-lived client such as wpub-recv).
  bool fail_fast = false;
  int max_message_bytes = 8 << 20;  // client-side send limit (the daemon enforces its own)
  wire::ClientTls tls;              // plaintext unless tls.ca_file is set
};

// Produces the bytes of one tensor: fills `out` (exactly desc.nbytes() bytes).
using TensorFiller = std::function<absl::Status(const TensorDesc& desc, absl::Span<uint8_t> out)>;

// The synthetic model's deterministic values (synthetic::FillTensor with `seed`).
TensorFiller SyntheticFiller(uint64_t seed);

enum class PayloadSource : uint8_t {
  kInline,  // chunk messages on the stream
  kShm,     // one POSIX shared-memory segment per batch, unlinked after the report
};

struct StreamOptions {
  PayloadSource source = PayloadSource::kInline;
  uint64_t chunk_bytes = uint64_t{1} << 20;  // inline chunk size
  // Split every tensor whose size along `concat_dim` is divisible by `parts` into that many
  // parts (as TP shards would arrive); 1 sends whole tensors.
  int parts = 1;
  int concat_dim = 0;
  std::string shm_prefix = "wpub-client";
  // Testing: cancel the RPC after sending this many batches (-1: never).
  int64_t cancel_after_batches = -1;
  // Called after each batch was sent (batch index), e.g. to pace or observe the stream.
  std::function<void(size_t)> on_batch_sent;
};

// Client-side timings of one Publish call.
struct PublishTimings {
  double send_seconds = 0;   // first message .. commit written
  double total_seconds = 0;  // first message .. report received
  uint64_t payload_bytes = 0;
  uint64_t messages = 0;
};

// Thread-safety: one Publish at a time per client; Cancel, GetStatus, ListReports and
// ConnectEngines from any thread.
class PublisherClient {
 public:
  static absl::StatusOr<std::unique_ptr<PublisherClient>> Create(const ClientOptions& options);

  // Streams one publication of `batches` with bytes from `fill` and waits for the report.
  // Returns the report (status COMMITTED or ABORTED), or the daemon's error (same code and
  // message as the gRPC status, which names the tensor or field at fault).
  absl::StatusOr<wpub::v1::PublicationReport> Publish(
      const wpub::v1::PublicationHeader& header,
      absl::Span<const synthetic::ConversionBatch> batches, const TensorFiller& fill,
      const StreamOptions& options, PublishTimings* timings = nullptr);

  // Sends exactly `requests`, half-closes and waits for the answer (for malformed streams).
  absl::StatusOr<wpub::v1::PublicationReport> PublishRaw(
      const std::vector<wpub::v1::PublishRequest>& requests);

  // Cancels the Publish in flight, if any.
  void Cancel();

  absl::StatusOr<wpub::v1::GetStatusResponse> GetStatus(uint32_t max_reports = 0);
  absl::StatusOr<std::vector<wpub::v1::PublicationReport>> ListReports(uint32_t limit = 0);
  // ConnectEngines (GPU path): blocks while the engines join, at most `rpc_timeout`, which
  // should exceed request.timeout_seconds (or the daemon's --engine_deadline when that is 0).
  absl::StatusOr<wpub::v1::ConnectEnginesResponse> ConnectEngines(
      const wpub::v1::ConnectEnginesRequest& request, absl::Duration rpc_timeout);
  // Restore: replays the retained committed version; blocks at most `rpc_timeout`.
  absl::StatusOr<wpub::v1::ReplayReport> Restore(const std::string& reason,
                                                 absl::Duration rpc_timeout);

 private:
  PublisherClient(const ClientOptions& options,
                  std::shared_ptr<grpc::ChannelCredentials> credentials);
  void Authorize(grpc::ClientContext* context) const;

  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<wpub::v1::Publisher::Stub> stub_;
  absl::Mutex mu_;
  grpc::ClientContext* active_ = nullptr;  // guarded by mu_
};

// Copies part `p` of the row-major tensor `full` split `parts` ways along `dim` into `out` (how
// Publish cuts tensors into TP-shard-like parts; exposed for tests).
void CopyPart(const TensorDesc& desc, absl::Span<const uint8_t> full, int dim, int parts, int p,
              std::vector<uint8_t>* out);
// How many parts `desc` is split into under `options` (1 when not divisible or rank too low).
int PartsFor(const TensorDesc& desc, const StreamOptions& options);

}  // namespace wpub::client
