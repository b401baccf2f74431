// The output file of a pull receiver and the version behind it: a version received in parts
// (one per member of its group) assembled into one, staged beside the output (fsynced) before
// the last acknowledgement and renamed into place on commit; what an existing output holds;
// the staging files of receiver processes that died. Used by Receiver::Impl (receiver.cc), whose
// mutex guards these values.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "clients/recv/safetensors.h"
#include "core/transport/types.h"

namespace wpub::recv {

// A publication being received.
struct Pending {
  transport::PublicationManifest manifest;
  std::vector<std::vector<uint8_t>> buckets;
  std::vector<uint64_t> checksums;  // each bucket's, once verified
  std::vector<bool> received;
  size_t num_received = 0;
  bool mismatch = false;    // a bucket failed its checksum: the publication will abort
  bool handed = false;      // complete: its manifest and buckets moved into the assembly
  uint64_t patch_base = 0;  // Manifest.patch_base: buckets may come as patches against it
};

// The version being assembled from every member of its group (one member outside a group):
// each member's manifest and buckets, once all of them arrived and verified.
struct Assembly {
  uint64_t version = 0;
  uint32_t members = 1;
  std::map<uint32_t, Pending> parts;  // by member index
  bool staged = false;                // the output file is staged (StagePath)
  bool complete() const { return parts.size() == members; }
};

// The members' manifests as one: buckets in member order, re-indexed.
transport::PublicationManifest MergedManifest(const Assembly& a);

// The tensors of `manifest` over `buckets` (indexed as the manifest's), for the output file.
std::vector<SafetensorsEntry> EntriesOf(const transport::PublicationManifest& manifest,
                                        const std::vector<std::vector<uint8_t>>& buckets);

// The output file's metadata: version, model id, recipe.
std::map<std::string, std::string> MetadataOf(const transport::PublicationManifest& manifest);

// FAILED_PRECONDITION naming the path unless `path` is not a directory and a file (`probe`) can
// be created beside it: found at start-up rather than after the daemon counted us committed.
absl::Status CheckOutputWritable(const std::string& path, const std::string& probe);

// The version recorded in an existing output file (0: no file, or none recorded). Reads only
// the header.
uint64_t VersionInFile(const std::string& path);

// The staging files (`<output>.staging-<pid>`) of receivers of this output that died before
// they committed or discarded them (killed between their last acknowledgement and the commit,
// say). The newest complete one holding a version above `held` is adopted -- renamed to `mine`,
// this process's staging file -- as a version in doubt, which the daemons decide once it
// subscribes (SubscribeRequest.staged_version); every other one is removed, so a full model's
// copy never stays on disk for good. A file whose process is still alive (another receiver
// writing the same output, which is the operator's mistake) is left alone. Returns the adopted
// version (0: none).
uint64_t AdoptOrphanedStaging(const std::string& output_path, uint64_t held,
                              const std::string& mine);

// This process's staging file beside `output_path`.
std::string StagePath(const std::string& output_path);

}  // namespace wpub::recv
