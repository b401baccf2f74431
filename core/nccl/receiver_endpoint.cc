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
#include "core/common/status.h"
#include "core/engine/checksum.h"
#include "core/gpu/status_kernels.h"
#include "core/nccl/group_member.h"
#include "nlohmann/json.hpp"

namespace wpub::nccl {
namespace {

using json = nlohmann::json;

void Reply(httplib::Response& res, const absl::Status& s, const std::string& ok_message) {
  res.status = s.ok() ? 200 : 400;
  res.set_content(
      json({{"success", s.ok()}, {"message", s.ok() ? ok_message : std::string(s.message())}})
          .dump(),
      "application/json");
}

}  // namespace

class ReceiverEndpoint::Impl {
  // One per device: its group rank, stream and bucket buffer. `member` is replaced only with
  // both mu_ and members_mu_ held; it is used for receives under mu_ and aborted under
  // members_mu_ alone (so an abort never waits for a receive in progress).
  struct Rank {
    int device = 0;
    std::unique_ptr<GroupMember> member;
    cudaStream_t stream = nullptr;
    void* buf = nullptr;
    uint64_t buf_bytes = 0;
    unsigned long long* sum = nullptr;       // device checksum accumulator
    unsigned long long* sum_host = nullptr;  // pinned: its read-back never pages
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
    }
    server_.stop();
    if (thread_.joinable()) thread_.join();
    std::lock_guard lock(mu_);
    std::lock_guard members(members_mu_);
    for (auto& rank : ranks_) {
      Rank& k = *rank;
      cudaSetDevice(k.device);
      k.member.reset();
      if (k.buf != nullptr) cudaFree(k.buf);
      if (k.sum != nullptr) cudaFree(k.sum);
      if (k.sum_host != nullptr) cudaFreeHost(k.sum_host);
      if (k.stream != nullptr) cudaStreamDestroy(k.stream);
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
      if (cudaSetDevice(k.device) != cudaSuccess ||
          cudaStreamCreateWithFlags(&k.stream, cudaStreamNonBlocking) != cudaSuccess ||
          cudaMalloc(reinterpret_cast<void**>(&k.sum), sizeof(unsigned long long)) != cudaSuccess ||
          cudaMallocHost(reinterpret_cast<void**>(&k.sum_host), sizeof(unsigned long long)) !=
              cudaSuccess) {
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
      json j = json::parse(q.body, nullptr, false);
      const std::string v = j.is_object() ? j.value("new_version", std::string()) : "";
      if (callbacks_.on_version) callbacks_.on_version(v);
      Reply(r, absl::OkStatus(), "version " + v);
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
    json j = json::parse(q.body, nullptr, false);
    if (!j.is_object()) return Reply(r, absl::InvalidArgumentError("body is not JSON"), "");
    GroupMemberOptions o;
    o.master_address = j.value("master_address", std::string("127.0.0.1"));
    o.master_port = j.value("master_port", 0);
    o.group_name = j.value("group_name", std::string());
    const int rank_offset = j.value("rank_offset", 1);
    o.world_size = j.value("world_size", 2);
    o.timeout = options_.join_timeout;
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
    json j = json::parse(body, nullptr, false);
    if (!j.is_object()) return absl::InvalidArgumentError("the request body is not JSON");
    const auto names = j.find("names"), dtypes = j.find("dtypes"), shapes = j.find("shapes");
    if (names == j.end() || dtypes == j.end() || shapes == j.end() || !names->is_array() ||
        !dtypes->is_array() || !shapes->is_array() || names->size() != dtypes->size() ||
        names->size() != shapes->size()) {
      return absl::InvalidArgumentError(
          "names, dtypes and shapes are required: arrays of one length");
    }
    ParsedUpdate out;
    ReceivedBucket& b = out.bucket;
    const auto g = j.find("group_name");
    if (g != j.end() && g->is_string()) out.group = g->get<std::string>();
    const auto v = j.find("weight_version");
    if (v != j.end() && v->is_string()) b.version = v->get<std::string>();
    const auto seq = j.find("wpub_sequence");
    if (seq != j.end()) {
      if (!seq->is_number_unsigned() || seq->get<uint64_t>() > (uint64_t{1} << 31)) {
        return absl::InvalidArgumentError("wpub_sequence must be an integer in [0, 2^31]");
      }
      out.sequence = static_cast<int64_t>(seq->get<uint64_t>());
    }
    b.tensors.reserve(names->size());
    uint64_t off = 0;
    for (size_t i = 0; i < names->size(); ++i) {
      const json &n = (*names)[i], &d = (*dtypes)[i], &sh = (*shapes)[i];
      if (!n.is_string() || !d.is_string() || !sh.is_array()) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", i, ": name and dtype must be strings, shape an array"));
      }
      engine::ManifestTensor t;
      t.name = n.get<std::string>();
      absl::StatusOr<DType> dt = ParseDType(d.get_ref<const std::string&>());
      if (!dt.ok())
        return absl::InvalidArgumentError(absl::StrCat(t.name, ": ", dt.status().message()));
      t.dtype = *dt;
      for (const json& e : sh) {
        if (!e.is_number_integer() || e.get<int64_t>() < 0) {
          return absl::InvalidArgumentError(
              absl::StrCat(t.name, ": shape ", sh.dump(), " is not a list of sizes"));
        }
        t.shape.push_back(e.get<int64_t>());
      }
      t.offset = off;
      t.nbytes = static_cast<uint64_t>(NumElements(t.shape) * DTypeSize(t.dtype));
      off += t.nbytes;
      b.tensors.push_back(std::move(t));
    }
    b.nbytes = off;
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

  // Grows every rank's bucket buffer to n bytes (mu_ held). Done before any receive is posted:
  // a cudaMalloc/cudaFree on one device while another device's broadcast is in flight in this
  // process can deadlock with it.
  absl::Status ReserveAll(uint64_t n) {
    for (auto& rank : ranks_) {
      Rank& k = *rank;
      if (n <= k.buf_bytes) continue;
      WPUB_RETURN_IF_ERROR(UseDevice(k.device));
      if (k.buf != nullptr) cudaFree(k.buf);
      k.buf = nullptr;
      k.buf_bytes = 0;
      if (const cudaError_t e = cudaMalloc(&k.buf, n); e != cudaSuccess) {
        k.buf = nullptr;
        return absl::ResourceExhaustedError(absl::StrCat("cannot allocate the bucket buffer of ", n,
                                                         " bytes on device ", k.device, ": ",
                                                         cudaGetErrorString(e)));
      }
      k.buf_bytes = n;
    }
    return absl::OkStatus();
  }

  // Waits for everything enqueued on the rank's stream without blocking in CUDA: polls the
  // stream, the communicator's asynchronous error, the other ranks' failure and the receive
  // timeout, so a broadcast that never comes cannot hang the handler.
  absl::Status WaitRank(Rank& k, const std::atomic<bool>& others_failed,
                        std::chrono::steady_clock::time_point deadline) {
    for (;;) {
      const cudaError_t e = cudaStreamQuery(k.stream);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) {
        return absl::InternalError(absl::StrCat("the bucket's receive failed on device ", k.device,
                                                ": ", cudaGetErrorString(e)));
      }
      if (others_failed) return absl::AbortedError("another rank of this engine failed");
      if (absl::Status s = k.member->AsyncError(); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("device ", k.device, ": ", s.message()));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("no broadcast completed on device ", k.device, " within ",
                         absl::FormatDuration(options_.receive_timeout)));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // Runs fn(rank index, failed) for every rank on a thread of its own (the ranks' receives are then
  // enqueued independently; one thread driving several devices would need NCCL group calls).
  // The first rank to fail raises `failed` and aborts every member, so the others end at once.
  // mu_ held. Returns the first error; after one, the group is unusable and is left.
  template <typename Fn>
  absl::Status OnEveryRank(Fn fn) {
    std::atomic<bool> failed{false};
    std::vector<std::future<absl::Status>> jobs;
    for (size_t i = 0; i < ranks_.size(); ++i) {
      jobs.push_back(std::async(std::launch::async, [&, i] {
        absl::Status s = fn(i, failed);
        if (!s.ok() && !failed.exchange(true)) AbortAll();
        return s;
      }));
    }
    absl::Status first;
    for (auto& f : jobs) {
      if (absl::Status s = f.get(); !s.ok() && first.ok()) first = s;
    }
    if (!first.ok()) Leave();
    return first;
  }

  // POST /receive_raw {"nbytes": n, "count": c}: c broadcasts of n bytes from rank 0 back to
  // back, no decoding and no checksum: the group's transfer limit, for benchmarks that compare a
  // publication with a plain broadcast of its bytes through the same group.
  void ReceiveRaw(const httplib::Request& q, httplib::Response& r) {
    json j = json::parse(q.body, nullptr, false);
    if (!j.is_object() || !j.contains("nbytes") || !j["nbytes"].is_number_unsigned() ||
        (j.contains("count") && !j["count"].is_number_unsigned())) {
      return Reply(r, absl::InvalidArgumentError("nbytes and count must be unsigned integers"), "");
    }
    const uint64_t n = j["nbytes"].get<uint64_t>();
    const uint64_t count = j.value("count", uint64_t{1});
    if (n == 0 || count == 0 || count > (uint64_t{1} << 20)) {
      return Reply(r, absl::InvalidArgumentError("nbytes must be > 0 and count in [1, 2^20]"), "");
    }
    std::lock_guard lock(mu_);
    if (!joined_) return Reply(r, absl::FailedPreconditionError("no weight-update group"), "");
    if (absl::Status s = ReserveAll(n); !s.ok()) return Reply(r, s, "");
    const auto t0 = std::chrono::steady_clock::now();
    const auto deadline = t0 + ToChrono(options_.receive_timeout);
    absl::Status s = OnEveryRank([&](size_t i, const std::atomic<bool>& failed) -> absl::Status {
      Rank& k = *ranks_[i];
      WPUB_RETURN_IF_ERROR(UseDevice(k.device));
      for (uint64_t c = 0; c < count; ++c) {
        WPUB_RETURN_IF_ERROR(k.member->Receive(k.buf, n, k.stream));
      }
      return WaitRank(k, failed, deadline);
    });
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    Reply(r, s, absl::StrCat("received ", count, " x ", n, " bytes in ", seconds, " s"));
  }

  // One rank's share of a bucket (buffers already reserved): receive, wait for it, then its
  // checksum, on the device (read back through pinned memory) or, for `bytes`, on the host after
  // copying the bucket back.
  absl::Status ReceiveOnRank(Rank& k, uint64_t n, std::vector<uint8_t>* bytes, uint64_t* checksum,
                             const std::atomic<bool>& failed,
                             std::chrono::steady_clock::time_point deadline) {
    WPUB_RETURN_IF_ERROR(UseDevice(k.device));
    WPUB_RETURN_IF_ERROR(k.member->Receive(k.buf, n, k.stream));
    WPUB_RETURN_IF_ERROR(WaitRank(k, failed, deadline));
    if (bytes != nullptr) {
      bytes->resize(n);
      if (const cudaError_t e = cudaMemcpy(bytes->data(), k.buf, n, cudaMemcpyDeviceToHost);
          e != cudaSuccess) {
        return absl::InternalError(absl::StrCat("copying the bucket back from device ", k.device,
                                                ": ", cudaGetErrorString(e)));
      }
      *checksum = engine::Checksum(bytes->data(), bytes->size());
      return absl::OkStatus();
    }
    cudaError_t e = cudaMemsetAsync(k.sum, 0, sizeof(*k.sum), k.stream);
    if (e == cudaSuccess) {
      e = gpu::LaunchChecksumAdd(static_cast<const uint8_t*>(k.buf), n, 0, k.sum, k.stream);
    }
    if (e == cudaSuccess) {
      e = cudaMemcpyAsync(k.sum_host, k.sum, sizeof(*k.sum), cudaMemcpyDeviceToHost, k.stream);
    }
    if (e != cudaSuccess) {
      return absl::InternalError(
          absl::StrCat("the bucket's checksum on device ", k.device, ": ", cudaGetErrorString(e)));
    }
    WPUB_RETURN_IF_ERROR(WaitRank(k, failed, deadline));
    *checksum = engine::ChecksumFinish(*k.sum_host, n);
    return absl::OkStatus();
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
    std::unique_lock lock(mu_);  // one weight update at a time, as SGLang
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
    // Whatever happens below, the next request of this run may go: after a failure the group is
    // left (OnEveryRank), so it fails on its own without posting a receive.
    struct Advance {
      Impl* self;
      bool ordered;
      ~Advance() {
        if (!ordered) return;
        ++self->next_sequence_;
        self->turn_.notify_all();
      }
    } advance{this, parsed->sequence >= 0};
    if (!joined_) return Reply(r, absl::FailedPreconditionError("no weight-update group"), "");
    if (absl::Status s = ReserveAll(off); !s.ok()) {
      Leave();  // nothing was posted, but the publisher's broadcast of this bucket will come
      return Reply(r, s, "");
    }
    const auto t_receive = std::chrono::steady_clock::now();
    const auto deadline = t_receive + ToChrono(options_.receive_timeout);
    std::vector<uint64_t> sums(ranks_.size(), 0);
    absl::Status failed = OnEveryRank([&](size_t i, const std::atomic<bool>& others) {
      std::vector<uint8_t>* bytes = i == 0 && options_.copy_to_host ? &b.bytes : nullptr;
      return ReceiveOnRank(*ranks_[i], off, bytes, &sums[i], others, deadline);
    });
    if (!failed.ok()) return Reply(r, failed, "");
    for (size_t i = 1; i < ranks_.size(); ++i) {
      if (sums[i] != sums[0]) {
        return Reply(r,
                     absl::DataLossError(absl::StrCat(
                         "version ", b.version, ": the bucket's checksum on device ",
                         ranks_[i]->device, " differs from device ", ranks_[0]->device, "'s")),
                     "");
      }
    }
    b.checksum = sums[0];
    if (parsed->sequence == 0) stats_.erase(b.version);  // a retried version starts afresh
    ReceiverVersionStats& st = stats_[b.version];
    const auto seconds = [](auto from, auto to) {
      return std::chrono::duration<double>(to - from).count();
    };
    st.decode_seconds += seconds(t_decode, t_wait);
    st.wait_seconds += seconds(t_wait, t_receive);
    st.receive_seconds += seconds(t_receive, std::chrono::steady_clock::now());
    b.index = static_cast<uint32_t>(st.buckets);
    ++st.buckets;
    st.bytes += off;
    st.checksums.push_back(b.checksum);
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
};

absl::StatusOr<std::unique_ptr<ReceiverEndpoint>> ReceiverEndpoint::Start(
    const ReceiverEndpointOptions& options, Callbacks callbacks) {
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
