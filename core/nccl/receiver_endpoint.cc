// ReceiverEndpoint: httplib routes -> one GroupMember per GPU; per GPU one bucket buffer grown
// on demand.
#include "core/nccl/receiver_endpoint.h"

#include <cuda_runtime_api.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/common/json_bounds.h"
#include "core/common/status.h"
#include "core/engine/checksum.h"
#include "core/rollout/update_request.h"
#include "kernels/cuda/status_kernels.h"
#include "core/gpu/streams.h"
#include "core/nccl/group_member.h"
#include "nlohmann/json.hpp"

namespace wpub::nccl {
namespace {

using json = nlohmann::json;

int64_t SteadyNanos(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// Requests one connection may carry before the server closes it (httplib's default is 5).
constexpr size_t kKeepAliveRequests = size_t{1} << 20;
// Server threads. httplib gives each open connection a thread until it has been idle for its
// keep-alive timeout (5 s); a publisher holds up to 8 (wpubd --engine_requests_in_flight), plus
// probes and /stats readers, whatever the host's core count (httplib's default pool).
constexpr size_t kServerThreads = 32;
// Largest request body: an update request carries one bucket's names, dtypes and shapes.
constexpr size_t kMaxRequestBytes = size_t{64} << 20;

// A request body as JSON, or a discarded value when it is not JSON or exceeds the bounds of
// client JSON (core/common/json_bounds.h): the callers answer "not JSON" either way.
nlohmann::json ParseBody(const std::string& body) {
  constexpr JsonBounds kBounds{kMaxRequestBytes, kClientJsonBounds.max_depth};
  if (!CheckJsonBounds(body, "body", kBounds).ok()) {
    return nlohmann::json(nlohmann::json::value_t::discarded);
  }
  return nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
}

void Reply(httplib::Response& res, const absl::Status& s, const std::string& ok_message) {
  res.status = s.ok() ? 200 : 400;
  res.set_content(
      json({{"success", s.ok()}, {"message", s.ok() ? ok_message : std::string(s.message())}})
          .dump(),
      "application/json");
}

}  // namespace

class ReceiverEndpoint::Impl {
  // One per device: its group rank, streams and two bucket slots (with device checksums,
  // bucket k+1 is received into one slot while bucket k's checksum is computed from the other).
  // `member` is replaced only with both mu_ and members_mu_ held; receives are enqueued under
  // mu_, aborts take members_mu_ alone (an abort never waits for a receive in progress), and a
  // verification outside mu_ holds its own reference.
  struct Rank {
    int device = 0;
    std::shared_ptr<GroupMember> member;
    cudaStream_t stream = nullptr;  // receives (and copies to the host)
    cudaStream_t verify = nullptr;  // checksums of received buckets
    void* buf[2] = {nullptr, nullptr};
    uint64_t buf_bytes = 0;                                // of each slot
    unsigned long long* sum[2] = {nullptr, nullptr};       // device checksum accumulators
    unsigned long long* sum_host[2] = {nullptr, nullptr};  // pinned: read-back never pages
    // The receive's start and end on `stream` (timed; the verify stream waits for `landed`), and
    // the end of its checksum's read-back on `verify`.
    cudaEvent_t posted[2] = {nullptr, nullptr};
    cudaEvent_t landed[2] = {nullptr, nullptr};
    cudaEvent_t verified[2] = {nullptr, nullptr};
  };

 public:
  Impl(ReceiverEndpointOptions options, Callbacks callbacks)
      : options_(std::move(options)), callbacks_(std::move(callbacks)) {}

  ~Impl() {
    // Handlers blocked in a receive whose publisher is gone, or waiting for their turn, end
    // first; then the server stops (it joins its handlers).
    stopping_ = true;
    AbortAll();
    {
      std::lock_guard lock(mu_);
      ++group_epoch_;
      turn_.notify_all();
      slot_free_.notify_all();
    }
    server_.stop();
    if (thread_.joinable()) thread_.join();
    std::lock_guard lock(mu_);
    std::lock_guard members(members_mu_);
    for (auto& rank : ranks_) {
      Rank& k = *rank;
      cudaSetDevice(k.device);
      k.member.reset();
      for (int slot = 0; slot < 2; ++slot) {
        if (k.buf[slot] != nullptr) cudaFree(k.buf[slot]);
        if (k.sum[slot] != nullptr) cudaFree(k.sum[slot]);
        if (k.sum_host[slot] != nullptr) cudaFreeHost(k.sum_host[slot]);
        if (k.verified[slot] != nullptr) cudaEventDestroy(k.verified[slot]);
        if (k.posted[slot] != nullptr) cudaEventDestroy(k.posted[slot]);
        if (k.landed[slot] != nullptr) cudaEventDestroy(k.landed[slot]);
      }
      if (k.stream != nullptr) cudaStreamDestroy(k.stream);
      if (k.verify != nullptr) cudaStreamDestroy(k.verify);
    }
  }

  absl::Status Start() {
    if (options_.devices.empty()) {
      return absl::InvalidArgumentError("receiver endpoint: no CUDA device given");
    }
    for (const int device : options_.devices) {
      ranks_.push_back(std::make_unique<Rank>());
      Rank& k = *ranks_.back();
      k.device = device;
      bool ok = cudaSetDevice(k.device) == cudaSuccess &&
                gpu::CreateStream(gpu::StreamRole::kCommunication, &k.stream) == cudaSuccess &&
                gpu::CreateStream(gpu::StreamRole::kCompute, &k.verify) == cudaSuccess;
      for (int slot = 0; ok && slot < 2; ++slot) {
        ok = cudaMalloc(reinterpret_cast<void**>(&k.sum[slot]), sizeof(unsigned long long)) ==
                 cudaSuccess &&
             cudaMallocHost(reinterpret_cast<void**>(&k.sum_host[slot]),
                            sizeof(unsigned long long)) == cudaSuccess &&
             cudaEventCreateWithFlags(&k.verified[slot], cudaEventDisableTiming) == cudaSuccess &&
             cudaEventCreate(&k.posted[slot]) == cudaSuccess &&
             cudaEventCreate(&k.landed[slot]) == cudaSuccess;
      }
      if (!ok) {
        (void)cudaGetLastError();
        return absl::FailedPreconditionError(
            absl::StrCat("receiver endpoint: CUDA device ", k.device, " is not usable"));
      }
    }
    server_.Get("/health", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(R"({"ok": true})", "application/json");
    });
    server_.Post("/init_weights_update_group",
                 [this](const httplib::Request& q, httplib::Response& r) { Join(q, r); });
    server_.Post("/destroy_weights_update_group",
                 [this](const httplib::Request&, httplib::Response& r) {
                   // A receive blocked on the group being destroyed ends first.
                   AbortAll();
                   std::lock_guard lock(mu_);
                   Leave();
                   Reply(r, absl::OkStatus(), "destroyed");
                 });
    server_.Post("/update_weights_from_distributed",
                 [this](const httplib::Request& q, httplib::Response& r) { Update(q, r); });
    server_.Post("/receive_raw",
                 [this](const httplib::Request& q, httplib::Response& r) { ReceiveRaw(q, r); });
    server_.Post("/update_weight_version", [this](const httplib::Request& q, httplib::Response& r) {
      json j = ParseBody(q.body);
      const std::string v = j.is_object() ? j.value("new_version", std::string()) : "";
      if (callbacks_.on_version) callbacks_.on_version(v);
      Reply(r, absl::OkStatus(), "version " + v);
    });
    // The engine's own account of every version it received (ReceiverVersionStats), for
    // tests and benchmarks that compare both sides of a publication.
    server_.Get("/stats", [this](const httplib::Request&, httplib::Response& r) {
      json j = json::object();
      for (const auto& [v, st] : stats()) {
        j[v] = {{"buckets", st.buckets},
                {"bytes", st.bytes},
                {"checksums", st.checksums},
                {"decode_seconds", st.decode_seconds},
                {"wait_seconds", st.wait_seconds},
                {"receive_seconds", st.receive_seconds},
                {"receive_device_seconds", st.receive_device_seconds},
                {"last_verified_ns", st.last_verified_ns}};
      }
      r.set_content(j.dump(), "application/json");
    });
    for (const char* path : {"/pause_generation", "/flush_cache", "/begin_weight_update",
                             "/end_weight_update", "/continue_generation"}) {
      auto ok = [](const httplib::Request&, httplib::Response& r) {
        Reply(r, absl::OkStatus(), "ok");
      };
      server_.Post(path, ok);
      server_.Get(path, ok);
    }
    server_.set_tcp_nodelay(true);
    // Update requests carry one bucket's names, dtypes and shapes; nothing legitimate is larger.
    server_.set_payload_max_length(kMaxRequestBytes);
    // A publisher keeps one connection per request lane for a whole publication (17+ update
    // requests and the lifecycle calls); httplib's default closes a connection after 5
    // requests, and each reconnection delayed the request behind it.
    server_.set_keep_alive_max_count(kKeepAliveRequests);
    server_.new_task_queue = [] { return new httplib::ThreadPool(kServerThreads); };
    port_ = options_.port == 0
                ? server_.bind_to_any_port(options_.host)
                : (server_.bind_to_port(options_.host, options_.port) ? options_.port : -1);
    if (port_ <= 0) {
      return absl::UnavailableError(
          absl::StrCat("receiver endpoint: cannot listen on ", options_.host, ":", options_.port));
    }
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    return absl::OkStatus();
  }

  int port() const { return port_; }
  std::map<std::string, ReceiverVersionStats> stats() const {
    std::lock_guard lock(mu_);
    return stats_;
  }

 private:
  // Joins a new group: the old one (if any) is aborted first, so a receive still blocked on it
  // ends; the new members are created without mu_ (the unique-id lookup may wait up to the join
  // timeout) and installed under it.
  void Join(const httplib::Request& q, httplib::Response& r) {
    json j = ParseBody(q.body);
    if (!j.is_object()) return Reply(r, absl::InvalidArgumentError("body is not JSON"), "");
    GroupMemberOptions o;
    o.master_address = j.value("master_address", std::string("127.0.0.1"));
    o.master_port = j.value("master_port", 0);
    o.group_name = j.value("group_name", std::string());
    const int rank_offset = j.value("rank_offset", 1);
    o.world_size = j.value("world_size", 2);
    o.timeout = options_.join_timeout;
    o.ctas = options_.nccl_ctas;
    AbortAll();
    // Every rank's communicator init is started before any is awaited (GroupMember::Join only
    // fetches the id and starts a nonblocking init), so the ranks of one engine join together.
    std::vector<std::unique_ptr<GroupMember>> members;
    for (size_t i = 0; i < ranks_.size(); ++i) {
      o.rank = rank_offset + static_cast<int>(i);
      o.device = ranks_[i]->device;
      if (absl::Status s = UseDevice(o.device); !s.ok()) return Reply(r, s, "");
      absl::StatusOr<std::unique_ptr<GroupMember>> m = GroupMember::Join(o);
      if (!m.ok()) return Reply(r, m.status(), "");
      members.push_back(*std::move(m));
    }
    std::lock_guard lock(mu_);
    Leave();
    {
      std::lock_guard guard(members_mu_);
      for (size_t i = 0; i < ranks_.size(); ++i) ranks_[i]->member = std::move(members[i]);
    }
    joined_ = true;
    group_name_ = o.group_name;
    Reply(r, absl::OkStatus(),
          absl::StrCat("joined ", o.group_name, " as ranks ", rank_offset, "..",
                       rank_offset + static_cast<int>(ranks_.size()) - 1));
  }

  // Drops the group (mu_ held): members destroyed, request order reset, waiters released.
  void Leave() {
    joined_ = false;
    group_name_.clear();
    {
      std::lock_guard guard(members_mu_);
      for (auto& rank : ranks_) {
        (void)UseDevice(rank->device);
        rank->member.reset();
      }
    }
    ++group_epoch_;
    sequence_version_.clear();
    next_sequence_ = 0;
    turn_.notify_all();
  }

  // Aborts every member's communicator (its kernels end, its pending receives fail); callable
  // with or without mu_.
  void AbortAll() {
    std::lock_guard guard(members_mu_);
    for (auto& rank : ranks_) {
      if (rank->member) rank->member->Abort();
    }
  }

  struct ParsedUpdate {
    ReceivedBucket bucket;  // tensors, version, nbytes
    std::string group;      // the request's group_name
    int64_t sequence = -1;  // `wpub_sequence`, -1 when absent
  };

  // The flattened-bucket request: names, dtypes and shapes laid back to back.
  static absl::StatusOr<ParsedUpdate> ParseUpdate(const std::string& body) {
    absl::StatusOr<rollout::UpdateRequest> request = rollout::DecodeUpdateRequest(body);
    if (!request.ok()) return request.status();
    ParsedUpdate out;
    out.group = std::move(request->fields.group_name);
    out.sequence = request->fields.sequence;
    out.bucket.version = std::move(request->fields.weight_version);
    out.bucket.tensors = std::move(request->tensors);
    out.bucket.nbytes = request->nbytes;
    return out;
  }

  // Requests that carry `wpub_sequence` (a publisher with several requests in flight per
  // engine) take their turn in that order within their version: NCCL matches broadcasts by
  // order, so bucket k's receive must be posted before bucket k + 1's. Sequence 0 starts a
  // publication (its predecessors were all answered). A group change ends the waiters.
  absl::Status AwaitTurn(const std::string& version, int64_t sequence,
                         std::unique_lock<std::mutex>& lock) {
    const uint64_t epoch = group_epoch_;
    const auto deadline = std::chrono::steady_clock::now() + ToChrono(options_.receive_timeout);
    if (sequence == 0) {
      sequence_version_ = version;
      next_sequence_ = 0;
      return absl::OkStatus();
    }
    for (;;) {
      if (group_epoch_ != epoch || stopping_) {
        return absl::AbortedError(absl::StrCat("version ", version, ": bucket ", sequence,
                                               " dropped: the weight-update group changed"));
      }
      if (version == sequence_version_) {
        if (sequence == next_sequence_) return absl::OkStatus();
        if (sequence < next_sequence_) {
          return absl::InvalidArgumentError(
              absl::StrCat("version ", version, ": bucket ", sequence, " arrived twice"));
        }
      }
      // A later bucket of this run, or one whose run's bucket 0 has not arrived yet: wait.
      if (turn_.wait_until(lock, deadline) == std::cv_status::timeout) {
        return absl::DeadlineExceededError(absl::StrCat("version ", version, ": bucket ", sequence,
                                                        " waited for bucket ", next_sequence_,
                                                        " (of version ", sequence_version_, ")"));
      }
    }
  }

  static std::chrono::microseconds ToChrono(absl::Duration d) {
    return std::chrono::microseconds(absl::ToInt64Microseconds(d));
  }

  // httplib runs each handler on a pool thread whose current device is the process default:
  // every handler selects the device of the rank it works on first.
  static absl::Status UseDevice(int device) {
    if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
      return absl::FailedPreconditionError(
          absl::StrCat("receiver endpoint: cudaSetDevice(", device, "): ", cudaGetErrorString(e)));
    }
    return absl::OkStatus();
  }

  // Grows every rank's two bucket slots to n bytes (mu_ held, through `lock`). Done before any
  // receive is posted (a cudaMalloc/cudaFree on one device while another device's broadcast is
  // in flight in this process can deadlock with it), and only once no slot is being verified.
  absl::Status ReserveAll(uint64_t n, std::unique_lock<std::mutex>& lock,
                          std::chrono::steady_clock::time_point deadline) {
    bool grow = false;
    for (auto& rank : ranks_) grow = grow || n > rank->buf_bytes;
    if (!grow) return absl::OkStatus();
    for (int slot = 0; slot < 2; ++slot) WPUB_RETURN_IF_ERROR(AwaitSlot(slot, lock, deadline));
    for (auto& rank : ranks_) {
      Rank& k = *rank;
      if (n <= k.buf_bytes) continue;
      WPUB_RETURN_IF_ERROR(UseDevice(k.device));
      k.buf_bytes = 0;
      for (int slot = 0; slot < 2; ++slot) {
        if (k.buf[slot] != nullptr) cudaFree(k.buf[slot]);
        k.buf[slot] = nullptr;
        if (const cudaError_t e = cudaMalloc(&k.buf[slot], n); e != cudaSuccess) {
          k.buf[slot] = nullptr;
          return absl::ResourceExhaustedError(absl::StrCat("cannot allocate the bucket buffers of ",
                                                           n, " bytes on device ", k.device, ": ",
                                                           cudaGetErrorString(e)));
        }
      }
      k.buf_bytes = n;
    }
    return absl::OkStatus();
  }

  // Waits (mu_ held, released while waiting) until `slot`'s previous bucket is verified.
  absl::Status AwaitSlot(int slot, std::unique_lock<std::mutex>& lock,
                         std::chrono::steady_clock::time_point deadline) {
    while (slot_busy_[slot]) {
      if (stopping_) return absl::UnavailableError("the engine is stopping");
      if (slot_free_.wait_until(lock, deadline) == std::cv_status::timeout && slot_busy_[slot]) {
        return absl::DeadlineExceededError("the previous bucket's verification did not finish");
      }
    }
    return absl::OkStatus();
  }

  // Enqueues one rank's share of a bucket into `slot` (device checksums): the receive on the
  // rank's stream, then on its verify stream the checksum and its read-back. Never waits: the
  // next bucket's receive can be posted right behind this one.
  static absl::Status EnqueueReceive(Rank& k, int slot, uint64_t n) {
    WPUB_RETURN_IF_ERROR(UseDevice(k.device));
    cudaError_t e = cudaStreamWaitEvent(k.stream, k.verified[slot], 0);
    if (e != cudaSuccess) return CudaStatus("ordering the receive", k.device, e);
    e = cudaEventRecord(k.posted[slot], k.stream);
    if (e != cudaSuccess) return CudaStatus("timing the receive", k.device, e);
    WPUB_RETURN_IF_ERROR(k.member->Receive(k.buf[slot], n, k.stream));
    e = cudaEventRecord(k.landed[slot], k.stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(k.verify, k.landed[slot], 0);
    if (e == cudaSuccess) e = EnqueueChecksum(k, slot, n, k.verify);
    if (e == cudaSuccess) e = cudaEventRecord(k.verified[slot], k.verify);
    if (e != cudaSuccess) return CudaStatus("enqueueing the bucket's checksum", k.device, e);
    return absl::OkStatus();
  }

  // On `stream`: the checksum of the n bytes in `slot`'s buffer into its device accumulator,
  // read back into its pinned word (ChecksumFinish(*k.sum_host[slot], n) once the stream is
  // past it).
  static cudaError_t EnqueueChecksum(Rank& k, int slot, uint64_t n, cudaStream_t stream) {
    cudaError_t e = cudaMemsetAsync(k.sum[slot], 0, sizeof(*k.sum[slot]), stream);
    if (e == cudaSuccess) {
      e = kernels::cuda::LaunchChecksumAdd(static_cast<const uint8_t*>(k.buf[slot]), n, 0, k.sum[slot],
                                 stream);
    }
    if (e == cudaSuccess) {
      e = cudaMemcpyAsync(k.sum_host[slot], k.sum[slot], sizeof(*k.sum[slot]),
                          cudaMemcpyDeviceToHost, stream);
    }
    return e;
  }

  static absl::Status CudaStatus(const char* what, int device, cudaError_t e) {
    return absl::InternalError(
        absl::StrCat(what, " on device ", device, ": ", cudaGetErrorString(e)));
  }

  // Waits for `query` (cudaStreamQuery or cudaEventQuery of a rank's work) to report success
  // without blocking in CUDA: polls it, the endpoint stopping, the other ranks' failure (when
  // given), the member's asynchronous error and the receive deadline, so a broadcast that never
  // comes cannot hang a handler. Callable with or without mu_.
  template <typename Query>
  absl::Status Poll(Query query, int device, GroupMember& member,
                    const std::atomic<bool>* others_failed,
                    std::chrono::steady_clock::time_point deadline) {
    for (;;) {
      const cudaError_t e = query();
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return CudaStatus("the bucket's receive", device, e);
      if (stopping_) return absl::UnavailableError("the engine is stopping");
      if (others_failed != nullptr && *others_failed) {
        return absl::AbortedError("another rank of this engine failed");
      }
      if (absl::Status s = member.AsyncError(); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("device ", device, ": ", s.message()));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("no broadcast completed on device ", device, " within ",
                         absl::FormatDuration(options_.receive_timeout)));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // Everything enqueued on the rank's stream (mu_ held).
  absl::Status WaitRank(Rank& k, const std::atomic<bool>& others_failed,
                        std::chrono::steady_clock::time_point deadline) {
    return Poll([&] { return cudaStreamQuery(k.stream); }, k.device, *k.member, &others_failed,
                deadline);
  }

  // Runs fn(rank index, failed) for every rank on a thread of its own (the ranks' receives are then
  // enqueued independently; one thread driving several devices would need NCCL group calls).
  // The first rank to fail raises `failed` and aborts every member, so the others end at once.
  // mu_ held. Returns the first error; after one, the group is unusable and is left.
  template <typename Fn>
  absl::Status OnEveryRank(Fn fn) {
    std::atomic<bool> failed{false};
    auto run = [&](size_t i) {
      absl::Status s = fn(i, failed);
      if (!s.ok() && !failed.exchange(true)) AbortAll();
      return s;
    };
    absl::Status first;
    if (ranks_.size() == 1) {
      first = run(0);  // one GPU: no thread to start per bucket
    } else {
      std::vector<std::future<absl::Status>> jobs;
      for (size_t i = 0; i < ranks_.size(); ++i) {
        jobs.push_back(std::async(std::launch::async, run, i));
      }
      for (auto& f : jobs) {
        if (absl::Status s = f.get(); !s.ok() && first.ok()) first = s;
      }
    }
    if (!first.ok()) Leave();
    return first;
  }

  // POST /receive_raw {"nbytes": n, "count": c}: c broadcasts of n bytes from rank 0 back to
  // back, no decoding and no checksum: the group's transfer limit, for benchmarks that compare a
  // publication with a plain broadcast of its bytes through the same group.
  void ReceiveRaw(const httplib::Request& q, httplib::Response& r) {
    json j = ParseBody(q.body);
    if (!j.is_object() || !j.contains("nbytes") || !j["nbytes"].is_number_unsigned() ||
        (j.contains("count") && !j["count"].is_number_unsigned())) {
      return Reply(r, absl::InvalidArgumentError("nbytes and count must be unsigned integers"), "");
    }
    const uint64_t n = j["nbytes"].get<uint64_t>();
    const uint64_t count = j.value("count", uint64_t{1});
    if (n == 0 || count == 0 || count > (uint64_t{1} << 20)) {
      return Reply(r, absl::InvalidArgumentError("nbytes must be > 0 and count in [1, 2^20]"), "");
    }
    std::unique_lock lock(mu_);
    if (!joined_) return Reply(r, absl::FailedPreconditionError("no weight-update group"), "");
    const auto t0 = std::chrono::steady_clock::now();
    const auto deadline = t0 + ToChrono(options_.receive_timeout);
    for (int slot = 0; slot < 2; ++slot) {
      if (absl::Status s = AwaitSlot(slot, lock, deadline); !s.ok()) return Reply(r, s, "");
    }
    if (absl::Status s = ReserveAll(n, lock, deadline); !s.ok()) return Reply(r, s, "");
    absl::Status s = OnEveryRank([&](size_t i, const std::atomic<bool>& failed) -> absl::Status {
      Rank& k = *ranks_[i];
      WPUB_RETURN_IF_ERROR(UseDevice(k.device));
      for (uint64_t c = 0; c < count; ++c) {
        WPUB_RETURN_IF_ERROR(k.member->Receive(k.buf[0], n, k.stream));
      }
      return WaitRank(k, failed, deadline);
    });
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    Reply(r, s, absl::StrCat("received ", count, " x ", n, " bytes in ", seconds, " s"));
  }

  // Copying to the host: one rank's share of a bucket (slot 0, buffers reserved), received and
  // waited for under mu_; rank 0 copies the bucket back and checksums it on the host, the other
  // ranks checksum on the device.
  absl::Status ReceiveOnRank(Rank& k, uint64_t n, std::vector<uint8_t>* bytes, uint64_t* checksum,
                             const std::atomic<bool>& failed,
                             std::chrono::steady_clock::time_point deadline) {
    WPUB_RETURN_IF_ERROR(UseDevice(k.device));
    WPUB_RETURN_IF_ERROR(k.member->Receive(k.buf[0], n, k.stream));
    WPUB_RETURN_IF_ERROR(WaitRank(k, failed, deadline));
    if (bytes != nullptr) {
      bytes->resize(n);
      if (const cudaError_t e = cudaMemcpy(bytes->data(), k.buf[0], n, cudaMemcpyDeviceToHost);
          e != cudaSuccess) {
        return CudaStatus("copying the bucket back", k.device, e);
      }
      *checksum = engine::Checksum(bytes->data(), bytes->size());
      return absl::OkStatus();
    }
    if (const cudaError_t e = EnqueueChecksum(k, 0, n, k.stream); e != cudaSuccess) {
      return CudaStatus("the bucket's checksum", k.device, e);
    }
    WPUB_RETURN_IF_ERROR(WaitRank(k, failed, deadline));
    *checksum = engine::ChecksumFinish(*k.sum_host[0], n);
    return absl::OkStatus();
  }

  // Per rank checksums must agree; the engine's checksum of the bucket.
  absl::StatusOr<uint64_t> AgreedChecksum(const std::vector<uint64_t>& sums,
                                          const std::string& version) const {
    for (size_t i = 1; i < ranks_.size(); ++i) {
      if (sums[i] != sums[0]) {
        return absl::DataLossError(
            absl::StrCat("version ", version, ": the bucket's checksum on device ",
                         ranks_[i]->device, " differs from device ", ranks_[0]->device, "'s"));
      }
    }
    return sums[0];
  }

  void Update(const httplib::Request& q, httplib::Response& r) {
    // Decoding the request needs no lock: with several requests in flight the next bucket's
    // is decoded while this one's broadcast is on the wire.
    const auto t_decode = std::chrono::steady_clock::now();
    absl::StatusOr<ParsedUpdate> parsed = ParseUpdate(q.body);
    if (!parsed.ok()) return Reply(r, parsed.status(), "");
    ReceivedBucket b = std::move(parsed->bucket);
    const uint64_t off = b.nbytes;
    const auto t_wait = std::chrono::steady_clock::now();
    const auto deadline = t_wait + ToChrono(options_.receive_timeout);
    std::unique_lock lock(mu_);  // receives are posted one bucket at a time, in order
    if (stopping_) return Reply(r, absl::UnavailableError("the engine is stopping"), "");
    // A request of another group (e.g. queued before a re-formation) never takes a turn.
    if (!parsed->group.empty() && parsed->group != group_name_) {
      return Reply(r,
                   absl::FailedPreconditionError(absl::StrCat("request for group '", parsed->group,
                                                              "'; this engine is in group '",
                                                              group_name_, "'")),
                   "");
    }
    if (parsed->sequence >= 0) {
      if (absl::Status s = AwaitTurn(b.version, parsed->sequence, lock); !s.ok()) {
        return Reply(r, s, "");
      }
    }
    // Whatever happens below, the next request of this run may go once this one has posted its
    // receive (or failed: the group is then left, so the next one fails without posting).
    struct Advance {
      Impl* self;
      bool ordered;
      void Now() {
        if (!ordered) return;
        ordered = false;
        ++self->next_sequence_;
        self->turn_.notify_all();
      }
      ~Advance() { Now(); }
    } advance{this, parsed->sequence >= 0};
    if (!joined_) return Reply(r, absl::FailedPreconditionError("no weight-update group"), "");
    if (absl::Status s = ReserveAll(off, lock, deadline); !s.ok()) {
      AbortAll();  // nothing was posted, but the publisher's broadcast of this bucket will come
      Leave();
      return Reply(r, s, "");
    }
    const auto t_receive = std::chrono::steady_clock::now();
    std::vector<uint64_t> sums(ranks_.size(), 0);
    if (parsed->sequence == 0) stats_.erase(b.version);  // a retried version starts afresh
    const auto seconds = [](auto from, auto to) {
      return std::chrono::duration<double>(to - from).count();
    };
    if (options_.copy_to_host) {
      absl::Status failed = OnEveryRank([&](size_t i, const std::atomic<bool>& others) {
        return ReceiveOnRank(*ranks_[i], off, i == 0 ? &b.bytes : nullptr, &sums[i], others,
                             deadline);
      });
      if (!failed.ok()) return Reply(r, failed, "");
      absl::StatusOr<uint64_t> sum = AgreedChecksum(sums, b.version);
      if (!sum.ok()) return Reply(r, sum.status(), "");
      b.checksum = *sum;
      ReceiverVersionStats& st = stats_[b.version];
      st.decode_seconds += seconds(t_decode, t_wait);
      st.wait_seconds += seconds(t_wait, t_receive);
      const auto t_verified = std::chrono::steady_clock::now();
      st.receive_seconds += seconds(t_receive, t_verified);
      st.last_verified_ns = std::max(st.last_verified_ns, SteadyNanos(t_verified));
      b.index = static_cast<uint32_t>(st.buckets);
      ++st.buckets;
      st.bytes += off;
      st.checksums.push_back(b.checksum);
      if (callbacks_.on_bucket) callbacks_.on_bucket(b);
      return Reply(r, absl::OkStatus(),
                   absl::StrCat("bucket ", b.index, ": ", b.tensors.size(), " tensors"));
    }

    // Device checksums: post this bucket's receives into the next slot, let the next request
    // post its own right behind them, and verify this one without the lock.
    const int slot = next_slot_;
    if (absl::Status s = AwaitSlot(slot, lock, deadline); !s.ok()) return Reply(r, s, "");
    absl::Status posted = OnEveryRank(
        [&](size_t i, const std::atomic<bool>&) { return EnqueueReceive(*ranks_[i], slot, off); });
    if (!posted.ok()) return Reply(r, posted, "");
    next_slot_ ^= 1;
    slot_busy_[slot] = true;
    ReceiverVersionStats& registered = stats_[b.version];
    b.index = static_cast<uint32_t>(registered.buckets);
    ++registered.buckets;
    registered.bytes += off;
    registered.checksums.push_back(0);  // filled in below, in order whatever finishes first
    const uint64_t epoch = group_epoch_;
    std::vector<std::shared_ptr<GroupMember>> members;
    for (auto& rank : ranks_) members.push_back(rank->member);
    advance.Now();
    lock.unlock();

    absl::Status verified = absl::OkStatus();
    float device_ms = 0;
    for (size_t i = 0; i < ranks_.size() && verified.ok(); ++i) {
      const cudaEvent_t done = ranks_[i]->verified[slot];
      verified = Poll([done] { return cudaEventQuery(done); }, ranks_[i]->device, *members[i],
                      nullptr, deadline);
      if (verified.ok()) sums[i] = engine::ChecksumFinish(*ranks_[i]->sum_host[slot], off);
      if (verified.ok() && i == 0 &&
          cudaEventElapsedTime(&device_ms, ranks_[0]->posted[slot], ranks_[0]->landed[slot]) !=
              cudaSuccess) {
        (void)cudaGetLastError();
        device_ms = 0;
      }
    }
    const auto t_verified = std::chrono::steady_clock::now();
    absl::StatusOr<uint64_t> sum =
        verified.ok() ? AgreedChecksum(sums, b.version) : absl::StatusOr<uint64_t>(verified);

    lock.lock();
    slot_busy_[slot] = false;
    slot_free_.notify_all();
    if (!sum.ok()) {
      if (group_epoch_ == epoch) {  // the group this bucket was received on is unusable
        AbortAll();
        Leave();
      }
      return Reply(r, sum.status(), "");
    }
    b.checksum = *sum;
    if (auto it = stats_.find(b.version);
        it != stats_.end() && b.index < it->second.checksums.size()) {
      ReceiverVersionStats& st = it->second;
      st.checksums[b.index] = b.checksum;
      st.decode_seconds += seconds(t_decode, t_wait);
      st.wait_seconds += seconds(t_wait, t_receive);
      st.receive_seconds += seconds(t_receive, t_verified);
      st.receive_device_seconds += device_ms / 1e3;
      st.last_verified_ns = std::max(st.last_verified_ns, SteadyNanos(t_verified));
    }
    lock.unlock();
    if (callbacks_.on_bucket) callbacks_.on_bucket(b);
    Reply(r, absl::OkStatus(),
          absl::StrCat("bucket ", b.index, ": ", b.tensors.size(), " tensors"));
  }

  const ReceiverEndpointOptions options_;
  const Callbacks callbacks_;
  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  mutable std::mutex mu_;
  std::mutex members_mu_;                              // after mu_ when both are taken
  std::vector<std::unique_ptr<Rank>> ranks_;           // never resized after Start
  bool joined_ = false;                                // guarded by mu_
  std::string group_name_;                             // guarded by mu_
  std::map<std::string, ReceiverVersionStats> stats_;  // guarded by mu_
  std::condition_variable turn_;                       // next_sequence_ advanced
  std::string sequence_version_;                       // guarded by mu_
  int64_t next_sequence_ = 0;                          // guarded by mu_
  uint64_t group_epoch_ = 0;  // guarded by mu_: bumped by join/destroy, ends stale waiters
  int next_slot_ = 0;         // guarded by mu_: the slot of the next bucket
  bool slot_busy_[2] = {false, false};  // guarded by mu_: a bucket in the slot is being verified
  std::condition_variable slot_free_;   // a slot's verification finished
};

absl::StatusOr<std::unique_ptr<ReceiverEndpoint>> ReceiverEndpoint::Start(
    const ReceiverEndpointOptions& options, Callbacks callbacks) {
  if (absl::Status s = CheckCtas(options.nccl_ctas, "receiver endpoint: nccl_ctas"); !s.ok()) {
    return s;
  }
  auto impl = std::make_unique<Impl>(options, std::move(callbacks));
  if (absl::Status s = impl->Start(); !s.ok()) return s;
  return std::unique_ptr<ReceiverEndpoint>(new ReceiverEndpoint(std::move(impl)));
}

ReceiverEndpoint::ReceiverEndpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ReceiverEndpoint::~ReceiverEndpoint() = default;
int ReceiverEndpoint::port() const { return impl_->port(); }
std::map<std::string, ReceiverVersionStats> ReceiverEndpoint::stats() const {
  return impl_->stats();
}

}  // namespace wpub::nccl
