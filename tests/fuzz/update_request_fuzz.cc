// Fuzz target `update_request`: the body of an `/update_weights_from_distributed` request as a
// C++ engine (wpub::recv::nccl::ReceiverEndpoint, wpub-recv) decodes it
// (core/rollout/update_request.h). The input is the body. Properties of an accepted body: the
// tensors tile [0, nbytes) back to back with dtype x shape bytes each, and encoding what was
// decoded and decoding that again gives the same tensors and fields.
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "core/rollout/update_request.h"
#include "tests/fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<wpub::rollout::UpdateRequest> r = wpub::rollout::DecodeUpdateRequest(body);
  if (!r.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(r.status()), r.status().ToString());
    return 0;
  }
  uint64_t offset = 0;
  for (const wpub::transport::ManifestTensor& t : r->tensors) {
    FUZZ_CHECK(t.offset == offset, t.name);
    uint64_t n = static_cast<uint64_t>(wpub::DTypeSize(t.dtype));
    for (int64_t d : t.shape) {
      FUZZ_CHECK(d >= 0, t.name);
      n *= static_cast<uint64_t>(d);
    }
    FUZZ_CHECK(n == t.nbytes, t.name);
    offset += t.nbytes;
  }
  FUZZ_CHECK(offset == r->nbytes, "the tensors do not add up to nbytes");

  const std::string again = wpub::rollout::EncodeUpdateRequest(r->tensors, r->fields);
  absl::StatusOr<wpub::rollout::UpdateRequest> back = wpub::rollout::DecodeUpdateRequest(again);
  FUZZ_CHECK(back.ok(), absl::StrCat(back.status().ToString(), " for ", again));
  FUZZ_CHECK(back->tensors == r->tensors, again);
  FUZZ_CHECK(back->nbytes == r->nbytes, again);
  FUZZ_CHECK(back->fields.group_name == r->fields.group_name, again);
  FUZZ_CHECK(back->fields.weight_version == r->fields.weight_version, again);
  FUZZ_CHECK(back->fields.flush_cache == r->fields.flush_cache, again);
  FUZZ_CHECK(back->fields.sequence == r->fields.sequence, again);
  // An empty load_format is not sent, so it decodes as the default.
  if (!r->fields.load_format.empty()) {
    FUZZ_CHECK(back->fields.load_format == r->fields.load_format, again);
  }
  return 0;
}
