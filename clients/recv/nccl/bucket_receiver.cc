// BucketReceiver: group membership, request order, and the two receive paths (a copy to the
// host under the lock, or device checksums pipelined two deep over DeviceRank's slots).
#include "clients/recv/nccl/bucket_receiver.h"

#include <algorithm>
#include <future>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/common/status.h"
#include "core/rollout/update_request.h"
#include "core/transport/checksum.h"

namespace wpub::recv::nccl {
namespace {

int64_t SteadyNanos(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

std::chrono::microseconds ToChrono(absl::Duration d) {
  return std::chrono::microseconds(absl::ToInt64Microseconds(d));
}

double Seconds(std::chrono::steady_clock::time_point from,
               std::chrono::steady_clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

std::string BucketMessage(const ReceivedBucket& b) {
  return absl::StrCat("bucket ", b.index, ": ", b.tensors.size(), " tensors");
}

}  // namespace

// A decoded update request and the moments its handling reached: decoding started, the wait for
// the lock and its turn started, the receives were posted.
struct BucketReceiver::ParsedUpdate {
  ReceivedBucket bucket;         // tensors, version, nbytes
  std::string group;             // the request's group_name
  int64_t sequence = -1;         // `wpub_sequence`, -1 when absent
  std::vector<uint64_t> chunks;  // the broadcasts that carry the bucket (one, or vLLM's packed)
  std::optional<rollout::UpdatePatch> patch;  // `wpub_patch`: the broadcast is this patch
  Clock::time_point decoding, waiting, receiving;
};

// Lets the next request of an ordered run take its turn (mu_ held): once this one posted its
// receive, or on any exit (a failure leaves the group, so the next one fails without posting).
struct BucketReceiver::Advance {
  BucketReceiver* self;
  bool ordered;
  void Now() {
    if (!ordered) return;
    ordered = false;
    ++self->next_sequence_;
    self->turn_.notify_all();
  }
  ~Advance() { Now(); }
};

absl::StatusOr<std::unique_ptr<BucketReceiver>> BucketReceiver::Create(
    const ReceiverEndpointOptions& options, OnBucket on_bucket) {
  if (options.devices.empty()) {
    return absl::InvalidArgumentError("receiver endpoint: no CUDA device given");
  }
  std::unique_ptr<BucketReceiver> r(new BucketReceiver(options, std::move(on_bucket)));
  for (const int device : options.devices) {
    WPUB_ASSIGN_OR_RETURN(std::unique_ptr<DeviceRank> rank, DeviceRank::Create(device));
    r->ranks_.push_back(std::move(rank));
  }
  r->members_.resize(r->ranks_.size());
  return r;
}

BucketReceiver::~BucketReceiver() {
  Stop();
  std::lock_guard lock(mu_);
  std::lock_guard members(members_mu_);
  for (size_t i = 0; i < ranks_.size(); ++i) {
    (void)ranks_[i]->UseDevice();
    members_[i].reset();
  }
}

void BucketReceiver::Stop() {
  stopping_ = true;
  AbortAll();
  std::lock_guard lock(mu_);
  ++group_epoch_;
  turn_.notify_all();
  slot_free_.notify_all();
}

absl::Status BucketReceiver::Join(GroupMemberOptions group, int rank_offset) {
  group.timeout = options_.join_timeout;
  group.ctas = options_.nccl_ctas;
  AbortAll();
  // GroupMember::Join only fetches the id and starts a nonblocking init, so the ranks of one
  // engine join together. Without mu_: the unique-id lookup may wait up to the join timeout.
  std::vector<std::unique_ptr<GroupMember>> members;
  for (size_t i = 0; i < ranks_.size(); ++i) {
    group.rank = rank_offset + static_cast<int>(i);
    group.device = ranks_[i]->device();
    WPUB_RETURN_IF_ERROR(ranks_[i]->UseDevice());
    WPUB_ASSIGN_OR_RETURN(std::unique_ptr<GroupMember> m, GroupMember::Join(group));
    members.push_back(std::move(m));
  }
  std::lock_guard lock(mu_);
  Leave();
  {
    std::lock_guard guard(members_mu_);
    for (size_t i = 0; i < ranks_.size(); ++i) members_[i] = std::move(members[i]);
  }
  if (group.rendezvous == Rendezvous::kVllm) {
    // vLLM's workers all-reduce one float once their communicator is up; the publisher waits
    // for it before it takes the join as answered (rank failures leave the group).
    const auto deadline = Clock::now() + ToChrono(options_.join_timeout);
    WPUB_RETURN_IF_ERROR(OnEveryRank([&](size_t i, const std::atomic<bool>& failed) {
      WPUB_RETURN_IF_ERROR(ranks_[i]->EnqueueWarmUp(*members_[i]));
      return WaitRank(i, failed, deadline);
    }));
  }
  joined_ = true;
  group_name_ = group.group_name;
  return absl::OkStatus();
}

void BucketReceiver::Destroy() {
  AbortAll();  // a receive blocked on the group being destroyed ends first
  std::lock_guard lock(mu_);
  Leave();
}

// mu_ held: members destroyed, request order reset, waiters released.
void BucketReceiver::Leave() {
  joined_ = false;
  group_name_.clear();
  {
    std::lock_guard guard(members_mu_);
    for (size_t i = 0; i < ranks_.size(); ++i) {
      (void)ranks_[i]->UseDevice();
      members_[i].reset();
    }
  }
  ++group_epoch_;
  sequence_version_.clear();
  next_sequence_ = 0;
  turn_.notify_all();
}

// Every member's communicator aborted (its kernels end, its pending receives fail); callable
// with or without mu_.
void BucketReceiver::AbortAll() {
  std::lock_guard guard(members_mu_);
  for (auto& member : members_) {
    if (member) member->Abort();
  }
}

std::map<std::string, ReceiverVersionStats> BucketReceiver::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

// Requests that carry `wpub_sequence` take their turn in that order within their version:
// bucket k's receive must be posted before bucket k + 1's. Sequence 0 starts a publication
// (its predecessors were all answered). A group change ends the waiters.
absl::Status BucketReceiver::AwaitTurn(const std::string& version, int64_t sequence,
                                       std::unique_lock<std::mutex>& lock) {
  const uint64_t epoch = group_epoch_;
  const auto deadline = Clock::now() + ToChrono(options_.receive_timeout);
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

// Grows every rank's slots to n bytes (mu_ held, through `lock`), before any receive is posted
// and only once no slot is being verified (DeviceRank::Reserve's precondition).
absl::Status BucketReceiver::ReserveAll(uint64_t n, std::unique_lock<std::mutex>& lock,
                                        Clock::time_point deadline) {
  bool grow = false;
  for (auto& rank : ranks_) grow = grow || n > rank->slot_bytes();
  if (!grow) return absl::OkStatus();
  for (int slot = 0; slot < DeviceRank::kSlots; ++slot) {
    WPUB_RETURN_IF_ERROR(AwaitSlot(slot, lock, deadline));
  }
  for (auto& rank : ranks_) WPUB_RETURN_IF_ERROR(rank->Reserve(n));
  return absl::OkStatus();
}

// Waits (mu_ held, released while waiting) until `slot`'s previous bucket is verified.
absl::Status BucketReceiver::AwaitSlot(int slot, std::unique_lock<std::mutex>& lock,
                                       Clock::time_point deadline) {
  while (slot_busy_[slot]) {
    if (stopping_) return absl::UnavailableError("the engine is stopping");
    if (slot_free_.wait_until(lock, deadline) == std::cv_status::timeout && slot_busy_[slot]) {
      return absl::DeadlineExceededError("the previous bucket's verification did not finish");
    }
  }
  return absl::OkStatus();
}

// Waits for `query` (cudaStreamQuery or cudaEventQuery of a rank's work) to report success
// without blocking in CUDA: polls it, Stop, the other ranks' failure (when given), the member's
// asynchronous error and the deadline, so a broadcast that never comes cannot hang a handler.
// Callable with or without mu_.
absl::Status BucketReceiver::Poll(absl::FunctionRef<cudaError_t()> query, int device,
                                  GroupMember& member, const std::atomic<bool>* others_failed,
                                  Clock::time_point deadline) {
  for (;;) {
    const cudaError_t e = query();
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) {
      return absl::InternalError(
          absl::StrCat("the bucket's receive on device ", device, ": ", cudaGetErrorString(e)));
    }
    if (stopping_) return absl::UnavailableError("the engine is stopping");
    if (others_failed != nullptr && *others_failed) {
      return absl::AbortedError("another rank of this engine failed");
    }
    if (absl::Status s = member.AsyncError(); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("device ", device, ": ", s.message()));
    }
    if (Clock::now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("no broadcast completed on device ", device, " within ",
                       absl::FormatDuration(options_.receive_timeout)));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// Everything enqueued on rank i's receive stream (mu_ held).
absl::Status BucketReceiver::WaitRank(size_t i, const std::atomic<bool>& others_failed,
                                      Clock::time_point deadline) {
  const cudaStream_t stream = ranks_[i]->receive_stream();
  return Poll([stream] { return cudaStreamQuery(stream); }, ranks_[i]->device(), *members_[i],
              &others_failed, deadline);
}

// The ranks' receives are enqueued independently, one thread each (one thread driving several
// devices would need NCCL group calls). The first rank to fail raises `failed` and aborts every
// member, so the others end at once. mu_ held. Returns the first error; after one, the group is
// unusable and is left.
absl::Status BucketReceiver::OnEveryRank(RankFn fn) {
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

absl::StatusOr<std::string> BucketReceiver::ReceiveRaw(uint64_t n, uint64_t count) {
  std::unique_lock lock(mu_);
  if (!joined_) return absl::FailedPreconditionError("no weight-update group");
  const auto t0 = Clock::now();
  const auto deadline = t0 + ToChrono(options_.receive_timeout);
  for (int slot = 0; slot < DeviceRank::kSlots; ++slot) {
    WPUB_RETURN_IF_ERROR(AwaitSlot(slot, lock, deadline));
  }
  WPUB_RETURN_IF_ERROR(ReserveAll(n, lock, deadline));
  WPUB_RETURN_IF_ERROR(OnEveryRank([&](size_t i, const std::atomic<bool>& failed) {
    for (uint64_t c = 0; c < count; ++c) {
      WPUB_RETURN_IF_ERROR(ranks_[i]->EnqueueReceive(*members_[i], 0, {n}));
    }
    return WaitRank(i, failed, deadline);
  }));
  return absl::StrCat("received ", count, " x ", n, " bytes in ", Seconds(t0, Clock::now()), " s");
}

absl::StatusOr<std::string> BucketReceiver::Update(const std::string& body) {
  // Decoding needs no lock: with several requests in flight the next bucket's is decoded while
  // this one's broadcast is on the wire.
  ParsedUpdate u;
  u.decoding = Clock::now();
  {
    WPUB_ASSIGN_OR_RETURN(rollout::UpdateRequest request, rollout::DecodeUpdateRequest(body));
    u.group = std::move(request.fields.group_name);
    u.sequence = request.fields.sequence;
    u.bucket.version = std::move(request.fields.weight_version);
    u.bucket.tensors = std::move(request.tensors);
    u.bucket.nbytes = request.nbytes;
    u.chunks = {request.nbytes};
    u.patch = request.fields.patch;
  }
  return ReceiveParsed(u);
}

absl::StatusOr<ReceivedBucket> BucketReceiver::ReceiveChunks(
    std::string version, std::vector<transport::ManifestTensor> tensors, uint64_t nbytes,
    std::vector<uint64_t> chunks) {
  if (!options_.copy_to_host) {
    return absl::FailedPreconditionError("ReceiveChunks needs copy_to_host");
  }
  ParsedUpdate u;
  u.decoding = Clock::now();
  u.bucket.version = std::move(version);
  u.bucket.tensors = std::move(tensors);
  u.bucket.nbytes = nbytes;
  u.chunks = std::move(chunks);
  WPUB_RETURN_IF_ERROR(ReceiveParsed(u).status());
  return std::move(u.bucket);
}

absl::StatusOr<std::string> BucketReceiver::ReceiveParsed(ParsedUpdate& u) {
  u.waiting = Clock::now();
  const auto deadline = u.waiting + ToChrono(options_.receive_timeout);
  std::unique_lock lock(mu_);  // receives are posted one bucket at a time, in order
  if (stopping_) return absl::UnavailableError("the engine is stopping");
  // A request of another group (e.g. queued before a re-formation) never takes a turn.
  if (!u.group.empty() && u.group != group_name_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "request for group '", u.group, "'; this engine is in group '", group_name_, "'"));
  }
  if (u.sequence >= 0) WPUB_RETURN_IF_ERROR(AwaitTurn(u.bucket.version, u.sequence, lock));
  Advance advance{this, u.sequence >= 0};
  if (!joined_) return absl::FailedPreconditionError("no weight-update group");
  // Kept weights receive whole buckets in place: the slots hold patches only.
  const bool kept = options_.keep_weights || u.patch.has_value();
  // The slots hold a patch, or a broadcast the kept path refuses (no wpub_sequence).
  const uint64_t slot_bytes = !kept                 ? u.bucket.nbytes
                              : u.patch.has_value() ? u.patch->bytes
                              : u.sequence < 0      ? u.bucket.nbytes
                                                    : 0;
  if (absl::Status s = ReserveAll(slot_bytes, lock, deadline); !s.ok()) {
    AbortAll();  // nothing was posted, but the publisher's broadcast of this bucket will come
    Leave();
    return s;
  }
  u.receiving = Clock::now();
  if (u.sequence == 0) stats_.erase(u.bucket.version);  // a retried version starts afresh
  if (kept) {
    // Slot 0 may take this broadcast: no pipelined bucket may still be verified from it.
    for (int slot = 0; slot < DeviceRank::kSlots; ++slot) {
      WPUB_RETURN_IF_ERROR(AwaitSlot(slot, lock, deadline));
    }
    return ReceiveKept(u, deadline);
  }
  if (options_.copy_to_host) return ReceiveCopied(u, deadline);
  return ReceivePipelined(u, advance, lock, deadline);
}

// Copying to the host: one rank's share of a bucket (slot 0, buffers reserved), received and
// waited for under mu_; rank 0 copies the bucket back and checksums it on the host, the other
// ranks checksum on the device.
absl::Status BucketReceiver::ReceiveOnRank(size_t i, absl::Span<const uint64_t> chunks, uint64_t n,
                                           std::vector<uint8_t>* bytes, uint64_t* checksum,
                                           const std::atomic<bool>& failed,
                                           Clock::time_point deadline) {
  DeviceRank& k = *ranks_[i];
  WPUB_RETURN_IF_ERROR(k.EnqueueReceive(*members_[i], 0, chunks));
  WPUB_RETURN_IF_ERROR(WaitRank(i, failed, deadline));
  if (bytes != nullptr) {
    WPUB_RETURN_IF_ERROR(k.CopyToHost(0, n, bytes));
    *checksum = transport::Checksum(bytes->data(), bytes->size());
    return absl::OkStatus();
  }
  WPUB_RETURN_IF_ERROR(k.EnqueueChecksum(0, n));
  WPUB_RETURN_IF_ERROR(WaitRank(i, failed, deadline));
  *checksum = k.Checksum(0, n);
  return absl::OkStatus();
}

// mu_ held throughout; on_bucket runs under it.
absl::StatusOr<std::string> BucketReceiver::ReceiveCopied(ParsedUpdate& u,
                                                          Clock::time_point deadline) {
  ReceivedBucket& b = u.bucket;
  std::vector<uint64_t> sums(ranks_.size(), 0);
  WPUB_RETURN_IF_ERROR(OnEveryRank([&](size_t i, const std::atomic<bool>& others) {
    return ReceiveOnRank(i, u.chunks, b.nbytes, i == 0 ? &b.bytes : nullptr, &sums[i], others,
                         deadline);
  }));
  WPUB_ASSIGN_OR_RETURN(b.checksum, AgreedChecksum(sums, ranks_, b.version));
  ReceiverVersionStats& st = stats_[b.version];
  st.decode_seconds += Seconds(u.decoding, u.waiting);
  st.wait_seconds += Seconds(u.waiting, u.receiving);
  const auto verified = Clock::now();
  st.receive_seconds += Seconds(u.receiving, verified);
  st.last_verified_ns = std::max(st.last_verified_ns, SteadyNanos(verified));
  b.index = static_cast<uint32_t>(st.buckets);
  ++st.buckets;
  st.bytes += b.nbytes;
  st.checksums.push_back(b.checksum);
  if (on_bucket_) on_bucket_(b);
  return BucketMessage(b);
}

// mu_ held throughout: a whole bucket received into its kept buffer, or a patch received into
// slot 0 and applied to it (nothing applied when this engine does not hold the patch's base:
// the broadcast is still taken, so that the group stays usable); the kept bucket's checksum
// verified on the device. kept_sums_[index] names a checksum only while every rank verifiably
// holds that bucket: it is cleared before anything may write the bucket and set again only
// from a verified result (or a verified restore of the base).
absl::StatusOr<std::string> BucketReceiver::ReceiveKept(ParsedUpdate& u,
                                                        Clock::time_point deadline) {
  ReceivedBucket& b = u.bucket;
  const uint64_t n = b.nbytes;
  // Whatever is refused, the publisher's broadcast of this request comes: take it into slot 0
  // (reserved for it by ReceiveParsed), so that the next request gets its own.
  auto take_and_refuse = [&](uint64_t bytes, absl::Status why) -> absl::Status {
    WPUB_RETURN_IF_ERROR(OnEveryRank([&](size_t i, const std::atomic<bool>& failed) {
      WPUB_RETURN_IF_ERROR(ranks_[i]->EnqueueReceive(*members_[i], 0, {bytes}));
      return WaitRank(i, failed, deadline);
    }));
    return why;
  };
  // The bucket's index is wpub_sequence, which wpubd sends every engine that takes patches (a
  // retried version starts again at 0): without it an index could drift.
  if (u.sequence < 0) {
    return take_and_refuse(u.patch.has_value() ? u.patch->bytes : n,
                           absl::FailedPreconditionError(absl::StrCat(
                               "version ", b.version,
                               ": an engine that keeps its weights needs wpub_sequence on "
                               "every update request (the bucket's index)")));
  }
  const uint32_t index = static_cast<uint32_t>(u.sequence);
  if (index >= kept_sums_.size()) kept_sums_.resize(index + 1);
  std::optional<uint64_t>& kept = kept_sums_[index];
  std::vector<uint64_t> sums(ranks_.size(), 0);
  if (u.patch.has_value()) {
    const rollout::UpdatePatch p = *u.patch;
    bool have = options_.keep_weights && kept == p.base_checksum;
    for (auto& rank : ranks_) have = have && rank->HasKept(index, n);
    if (!have) {
      return take_and_refuse(
          p.bytes,
          absl::FailedPreconditionError(absl::StrCat(
              "version ", b.version, " bucket ", index, ": a patch against v", p.base_version,
              options_.keep_weights
                  ? ", whose bucket this engine does not hold"
                  : ": this engine keeps no weights (wpub-recv --engine_patches)")));
    }
    kept.reset();  // from here the bucket may change
    WPUB_RETURN_IF_ERROR(OnEveryRank([&](size_t i, const std::atomic<bool>& failed) {
      WPUB_RETURN_IF_ERROR(ranks_[i]->EnqueueReceive(*members_[i], 0, {p.bytes}));
      WPUB_RETURN_IF_ERROR(ranks_[i]->EnqueueKeptPatch(index, n, p.bytes));
      return WaitRank(i, failed, deadline);
    }));
    bool refused = false, all_refused = true;
    for (size_t i = 0; i < ranks_.size(); ++i) {
      refused |= ranks_[i]->PatchRefused();
      all_refused &= ranks_[i]->PatchRefused();
      sums[i] = ranks_[i]->KeptChecksum(index);
    }
    if (refused) {
      // Refused on every rank: nothing was applied. (The ranks received the same bytes, so a
      // split refusal means a rank's receive was not this patch: its bucket is unknown.)
      if (all_refused) kept = p.base_checksum;
      return absl::InvalidArgumentError(absl::StrCat("version ", b.version, " bucket ", index,
                                                     ": the patch is malformed (format 3)"));
    }
    absl::StatusOr<uint64_t> sum = AgreedChecksum(sums, ranks_, b.version);
    if (!sum.ok() || *sum != p.target_checksum) {
      // Applied again, the patch gives the base back: verified on every rank before the bucket
      // counts as the base again.
      WPUB_RETURN_IF_ERROR(OnEveryRank([&](size_t i, const std::atomic<bool>& failed) {
        WPUB_RETURN_IF_ERROR(ranks_[i]->EnqueueKeptPatch(index, n, p.bytes));
        return WaitRank(i, failed, deadline);
      }));
      bool restored = true;
      for (size_t i = 0; i < ranks_.size(); ++i) {
        restored &= !ranks_[i]->PatchRefused() && ranks_[i]->KeptChecksum(index) == p.base_checksum;
      }
      if (restored) kept = p.base_checksum;
      return !sum.ok() ? sum.status()
                       : absl::DataLossError(absl::StrCat(
                             "version ", b.version, " bucket ", index,
                             ": the patched bucket does not have the target's checksum (",
                             restored ? "restored" : "not restored", ")"));
    }
    kept = *sum;
  } else {
    kept.reset();  // overwritten from here on
    for (auto& rank : ranks_) {
      if (absl::Status s = rank->ReserveKept(index, n); !s.ok()) {
        // Nothing was posted, but the publisher's broadcast of this bucket will come.
        AbortAll();
        Leave();
        return s;
      }
    }
    WPUB_RETURN_IF_ERROR(OnEveryRank([&](size_t i, const std::atomic<bool>& failed) {
      WPUB_RETURN_IF_ERROR(ranks_[i]->EnqueueKeptReceive(*members_[i], index, u.chunks));
      return WaitRank(i, failed, deadline);
    }));
    for (size_t i = 0; i < ranks_.size(); ++i) sums[i] = ranks_[i]->KeptChecksum(index);
    WPUB_ASSIGN_OR_RETURN(kept, AgreedChecksum(sums, ranks_, b.version));
  }
  b.checksum = *kept;
  ReceiverVersionStats& st = stats_[b.version];
  st.decode_seconds += Seconds(u.decoding, u.waiting);
  st.wait_seconds += Seconds(u.waiting, u.receiving);
  const auto verified = Clock::now();
  st.receive_seconds += Seconds(u.receiving, verified);
  st.last_verified_ns = std::max(st.last_verified_ns, SteadyNanos(verified));
  b.index = index;
  ++st.buckets;
  st.bytes += n;
  if (u.patch.has_value()) {
    ++st.patched_buckets;
    st.patch_bytes += u.patch->bytes;
  }
  st.checksums.push_back(b.checksum);
  if (on_bucket_) on_bucket_(b);
  return BucketMessage(b);
}

// Device checksums: this bucket's receives are posted into the next slot, the next request may
// post its own right behind them, and this one is verified without the lock.
absl::StatusOr<std::string> BucketReceiver::ReceivePipelined(ParsedUpdate& u, Advance& advance,
                                                             std::unique_lock<std::mutex>& lock,
                                                             Clock::time_point deadline) {
  ReceivedBucket& b = u.bucket;
  const uint64_t n = b.nbytes;
  const int slot = next_slot_;
  WPUB_RETURN_IF_ERROR(AwaitSlot(slot, lock, deadline));
  WPUB_RETURN_IF_ERROR(OnEveryRank([&](size_t i, const std::atomic<bool>&) {
    return ranks_[i]->EnqueueVerifiedReceive(*members_[i], slot, u.chunks);
  }));
  next_slot_ ^= 1;
  slot_busy_[slot] = true;
  ReceiverVersionStats& registered = stats_[b.version];
  b.index = static_cast<uint32_t>(registered.buckets);
  ++registered.buckets;
  registered.bytes += n;
  registered.checksums.push_back(0);  // filled in below, in order whatever finishes first
  const uint64_t epoch = group_epoch_;
  const std::vector<std::shared_ptr<GroupMember>> members = members_;
  advance.Now();
  lock.unlock();

  absl::Status verified = absl::OkStatus();
  std::vector<uint64_t> sums(ranks_.size(), 0);
  double device_seconds = 0;
  for (size_t i = 0; i < ranks_.size() && verified.ok(); ++i) {
    const cudaEvent_t done = ranks_[i]->verified(slot);
    verified = Poll([done] { return cudaEventQuery(done); }, ranks_[i]->device(), *members[i],
                    nullptr, deadline);
    if (verified.ok()) sums[i] = ranks_[i]->Checksum(slot, n);
    if (verified.ok() && i == 0) device_seconds = ranks_[0]->ReceiveDeviceSeconds(slot);
  }
  const auto t_verified = Clock::now();
  absl::StatusOr<uint64_t> sum =
      verified.ok() ? AgreedChecksum(sums, ranks_, b.version) : absl::StatusOr<uint64_t>(verified);

  lock.lock();
  slot_busy_[slot] = false;
  slot_free_.notify_all();
  if (!sum.ok()) {
    if (group_epoch_ == epoch) {  // the group this bucket was received on is unusable
      AbortAll();
      Leave();
    }
    return sum.status();
  }
  b.checksum = *sum;
  if (auto it = stats_.find(b.version);
      it != stats_.end() && b.index < it->second.checksums.size()) {
    ReceiverVersionStats& st = it->second;
    st.checksums[b.index] = b.checksum;
    st.decode_seconds += Seconds(u.decoding, u.waiting);
    st.wait_seconds += Seconds(u.waiting, u.receiving);
    st.receive_seconds += Seconds(u.receiving, t_verified);
    st.receive_device_seconds += device_seconds;
    st.last_verified_ns = std::max(st.last_verified_ns, SteadyNanos(t_verified));
  }
  lock.unlock();
  if (on_bucket_) on_bucket_(b);
  return BucketMessage(b);
}

}  // namespace wpub::recv::nccl
