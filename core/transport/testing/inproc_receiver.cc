// In-process pull receiver (see inproc_receiver.h).
#include "core/transport/testing/inproc_receiver.h"

#include <algorithm>

#include <variant>

#include "core/transport/checksum.h"

namespace wpub::transport::testing {

absl::StatusOr<std::unique_ptr<InprocReceiver>> InprocReceiver::Start(
    PullTransport* transport, InprocReceiverOptions options) {
  absl::StatusOr<std::unique_ptr<Subscription>> sub =
      transport->Subscribe(options.name, options.held_version);
  if (!sub.ok()) return sub.status();
  std::unique_ptr<InprocReceiver> r(new InprocReceiver(*std::move(sub), std::move(options)));
  r->thread_ = std::thread([p = r.get()] { p->Run(); });
  return r;
}

InprocReceiver::InprocReceiver(std::unique_ptr<Subscription> sub, InprocReceiverOptions options)
    : options_(std::move(options)), sub_(std::move(sub)) {}

InprocReceiver::~InprocReceiver() { Stop(); }

void InprocReceiver::Stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
  sub_.reset();
}

void InprocReceiver::Run() {
  uint64_t version = 0;
  PublicationManifest manifest;
  std::vector<std::shared_ptr<const Bucket>> staged;
  int acked = 0;
  std::string token;  // from the GroupInfoEvent, the first event
  while (true) {
    {
      std::lock_guard lock(mu_);
      if (stop_) return;
    }
    absl::StatusOr<ReceiverEvent> event = sub_->Next(absl::Milliseconds(50));
    if (absl::IsDeadlineExceeded(event.status())) continue;
    if (!event.ok()) return;
    if (auto* info = std::get_if<GroupInfoEvent>(&*event)) {
      token = info->subscription_token;
    } else if (auto* m = std::get_if<ManifestEvent>(&*event)) {
      manifest = m->manifest;
      version = manifest.version;
      staged.assign(manifest.buckets.size(), nullptr);
      acked = 0;
    } else if (auto* ready = std::get_if<BucketReadyEvent>(&*event)) {
      if (ready->version != version) continue;
      absl::StatusOr<std::shared_ptr<const Bucket>> bucket =
          sub_->ReadBucket(token, ready->version, ready->index, ready->attempt);
      if (!bucket.ok()) continue;
      const uint64_t sum = Checksum((*bucket)->bytes.data(), (*bucket)->bytes.size());
      {
        std::lock_guard lock(mu_);
        bytes_read_ += (*bucket)->bytes.size();
        if (sum != ready->checksum) ++mismatches_;
      }
      if (options_.keep_tensors) staged[ready->index] = *bucket;
      if (options_.never_ack) continue;
      (void)sub_->Ack(token, ready->version, ready->index,
                      options_.corrupt_checksum ? sum ^ 1 : sum, ready->attempt);
      ++acked;
      if (options_.leave_after_buckets >= 0 && acked >= options_.leave_after_buckets) {
        sub_->Close();
        std::lock_guard lock(mu_);
        left_ = true;
        cv_.notify_all();
        return;
      }
    } else if (auto* commit = std::get_if<CommitEvent>(&*event)) {
      if (commit->version != version) continue;
      std::lock_guard lock(mu_);
      committed_version_ = commit->version;
      tensors_.clear();
      manifest_.clear();
      for (size_t b = 0; b < manifest.buckets.size(); ++b) {
        for (const ManifestTensor& t : manifest.buckets[b].tensors) {
          manifest_[t.name] = t;
          if (options_.keep_tensors && staged[b]) {
            const uint8_t* p = staged[b]->bytes.data() + t.offset;
            tensors_[t.name].assign(p, p + t.nbytes);
          }
        }
      }
      staged.clear();
      cv_.notify_all();
    } else if (auto* abort = std::get_if<AbortEvent>(&*event)) {
      std::lock_guard lock(mu_);
      aborted_.push_back(abort->version);
      staged.clear();
      cv_.notify_all();
    }
  }
}

bool InprocReceiver::WaitForOutcome(uint64_t version, absl::Duration timeout) {
  std::unique_lock lock(mu_);
  return cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout), [&] {
    if (committed_version_ == version) return true;
    for (uint64_t v : aborted_) {
      if (v == version) return true;
    }
    return left_;
  });
}

bool InprocReceiver::WaitForCommitted(uint64_t version, absl::Duration timeout) {
  std::unique_lock lock(mu_);
  return cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout),
                      [&] { return committed_version_ == version; });
}

bool InprocReceiver::WaitForAborts(uint64_t version, size_t count, absl::Duration timeout) {
  std::unique_lock lock(mu_);
  return cv_.wait_for(lock, absl::ToChronoNanoseconds(timeout), [&] {
    return left_ ||
           static_cast<size_t>(std::count(aborted_.begin(), aborted_.end(), version)) >= count;
  });
}

uint64_t InprocReceiver::committed_version() const {
  std::lock_guard lock(mu_);
  return committed_version_;
}
std::vector<uint64_t> InprocReceiver::aborted_versions() const {
  std::lock_guard lock(mu_);
  return aborted_;
}
std::map<std::string, std::vector<uint8_t>> InprocReceiver::committed_tensors() const {
  std::lock_guard lock(mu_);
  return tensors_;
}
std::map<std::string, ManifestTensor> InprocReceiver::committed_manifest() const {
  std::lock_guard lock(mu_);
  return manifest_;
}
uint64_t InprocReceiver::checksum_mismatches() const {
  std::lock_guard lock(mu_);
  return mismatches_;
}
bool InprocReceiver::left() const {
  std::lock_guard lock(mu_);
  return left_;
}
uint64_t InprocReceiver::bytes_read() const {
  std::lock_guard lock(mu_);
  return bytes_read_;
}

}  // namespace wpub::transport::testing
