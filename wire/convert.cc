// Wire <-> engine conversions.
#include "wire/convert.h"

#include <string>
#include <type_traits>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/common/status.h"

namespace wpub::wire {
namespace {

namespace pb = ::wpub::v1;

absl::StatusOr<Shape> ShapeFromProto(const google::protobuf::RepeatedField<int64_t>& dims,
                                     absl::string_view what) {
  Shape shape(dims.begin(), dims.end());
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": dim ", i, " is negative (", shape[i], ")"));
    }
  }
  return shape;
}

absl::StatusOr<engine::TensorPart> PartFromProto(const pb::TensorPart& part,
                                                 absl::string_view tensor, int index) {
  engine::TensorPart out;
  const std::string what = absl::StrCat("tensor '", tensor, "' part ", index);
  WPUB_ASSIGN_OR_RETURN(out.shape, ShapeFromProto(part.shape(), absl::StrCat(what, " shape")));
  switch (part.source_case()) {
    case pb::TensorPart::kInline:
      out.source = engine::InlineSource{};
      break;
    case pb::TensorPart::kShm:
      out.source = engine::ShmSource{part.shm().name(), part.shm().offset(), part.shm().length()};
      break;
    case pb::TensorPart::kCudaIpc: {
      const auto& ipc = part.cuda_ipc();
      engine::CudaIpcSource src;
      if (ipc.handle().size() != src.handle.size()) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": cuda_ipc.handle has ",
                                                       ipc.handle().size(), " bytes, expected ",
                                                       src.handle.size()));
      }
      std::copy(ipc.handle().begin(), ipc.handle().end(), src.handle.begin());
      src.device_uuid = ipc.device_uuid();
      src.offset = ipc.offset();
      src.length = ipc.length();
      out.source = std::move(src);
      break;
    }
    case pb::TensorPart::SOURCE_NOT_SET:
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": no source (set one of inline, shm, cuda_ipc)"));
  }
  return out;
}

pb::PublicationStatus StatusToProto(engine::PublicationStatus status) {
  switch (status) {
    case engine::PublicationStatus::kCommitted:
      return pb::PUBLICATION_STATUS_COMMITTED;
    case engine::PublicationStatus::kAborted:
      return pb::PUBLICATION_STATUS_ABORTED;
    case engine::PublicationStatus::kFailed:
      return pb::PUBLICATION_STATUS_FAILED;
  }
  return pb::PUBLICATION_STATUS_UNSPECIFIED;
}

int64_t UnixNanos(absl::Time t) { return t == absl::InfinitePast() ? 0 : absl::ToUnixNanos(t); }

void ManifestTensorToProto(const transport::ManifestTensor& t, pb::ManifestTensor* out) {
  out->set_name(t.name);
  out->set_dtype(std::string(DTypeName(t.dtype)));
  for (int64_t d : t.shape) out->add_shape(d);
  out->set_offset(t.offset);
  out->set_nbytes(t.nbytes);
}

}  // namespace

std::string PrecisionExceptionsJson(const pb::PrecisionExceptions& e) {
  nlohmann::json j = nlohmann::json::object();
  if (e.extra_high_precision_layers_megatron_size() > 0) {
    j["extra_high_precision_layers_megatron"] =
        std::vector<std::string>(e.extra_high_precision_layers_megatron().begin(),
                                 e.extra_high_precision_layers_megatron().end());
  }
  if (e.extra_high_precision_layers_hf_size() > 0) {
    j["extra_high_precision_layers_hf"] = std::vector<std::string>(
        e.extra_high_precision_layers_hf().begin(), e.extra_high_precision_layers_hf().end());
  }
  if (e.first_last_layers_bf16()) j["first_last_layers_bf16"] = true;
  if (e.num_layers() != 0) j["num_layers"] = e.num_layers();
  if (e.num_layers_at_start_in_bf16() != 0) {
    j["num_layers_at_start_in_bf16"] = e.num_layers_at_start_in_bf16();
  }
  if (e.num_layers_at_end_in_bf16() != 0) {
    j["num_layers_at_end_in_bf16"] = e.num_layers_at_end_in_bf16();
  }
  if (e.allow_nothing_quantized()) j["allow_nothing_quantized"] = true;
  return j.empty() ? std::string() : j.dump();
}

absl::StatusOr<engine::PublicationHeader> FromProto(const pb::PublicationHeader& header) {
  engine::PublicationHeader out;
  if (header.version() == 0) {
    return absl::InvalidArgumentError("header.version must be >= 1 (0 means 'none committed')");
  }
  out.version = header.version();
  out.model_id = header.model_id();
  if (!header.recipe().empty()) out.recipe = header.recipe();
  out.quantization_config_json = header.quantization_config_json();
  out.policy_json = PrecisionExceptionsJson(header.precision_exceptions());
  out.allow_non_finite = header.allow_non_finite();
  out.queue = header.queue();
  out.bucket_bytes = header.bucket_bytes();
  out.release_backend_memory = header.release_gpu_memory();
  if (header.has_group()) {
    const pb::GroupMembership& g = header.group();
    engine::GroupMembership m;
    m.group = g.group();
    m.members = g.members();
    m.member = g.member();
    m.leader = g.leader();
    m.publisher = g.publisher();
    if (!(g.timeout_seconds() >= 0) || g.timeout_seconds() > 86400) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.group.timeout_seconds must be in [0, 86400], got ", g.timeout_seconds()));
    }
    m.timeout = absl::Seconds(g.timeout_seconds());
    out.group = std::move(m);  // checked by Engine::Open (ValidateGroupMembership)
  }
  return out;
}

void ToProto(const engine::PhaseSeconds& s, pb::PhaseSeconds* p) {
  p->set_ingest(s.ingest);
  p->set_policy(s.policy);
  p->set_quantize(s.quantize);
  p->set_pack(s.pack);
  p->set_transfer(s.transfer);
  p->set_commit(s.commit);
  p->set_group(s.group);
}

engine::PhaseSeconds FromProto(const pb::PhaseSeconds& p) {
  engine::PhaseSeconds s;
  s.ingest = p.ingest();
  s.policy = p.policy();
  s.quantize = p.quantize();
  s.pack = p.pack();
  s.transfer = p.transfer();
  s.commit = p.commit();
  s.group = p.group();
  return s;
}

void ToProto(const engine::GroupSummary& g, pb::GroupSummary* out) {
  out->set_group(g.group);
  out->set_version(g.version);
  out->set_members(g.members);
  out->set_member(g.member);
  out->set_leader(g.leader);
  out->set_outcome(g.outcome);
  out->set_error(g.error);
  out->set_slowest_member(g.slowest_member);
  out->set_failed_member(g.failed_member);
  out->set_coordination_seconds(g.coordination_seconds);
  for (const engine::GroupMemberSummary& m : g.members_detail) {
    pb::GroupMemberSummary* o = out->add_members_detail();
    o->set_member(m.member);
    o->set_publisher(m.publisher);
    o->set_state(m.state);
    o->set_tensors(m.tensors);
    o->set_bytes_in(m.bytes_in);
    o->set_bytes_out(m.bytes_out);
    o->set_buckets(m.buckets);
    o->set_engines(m.engines);
    ToProto(m.phases, o->mutable_phases());
    o->set_seconds(m.seconds);
    o->set_error(m.error);
  }
}

absl::StatusOr<engine::BatchInput> FromProto(const pb::Batch& batch) {
  engine::BatchInput out;
  out.megatron_name = batch.megatron_name();
  out.tensors.reserve(batch.tensors_size());
  for (const pb::TensorDescriptor& t : batch.tensors()) {
    engine::TensorInput in;
    in.desc.name = t.name();
    if (t.name().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("batch '", batch.megatron_name(), "': a tensor has an empty name"));
    }
    absl::StatusOr<DType> dtype = ParseDType(t.dtype());
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name(), "': unknown dtype '", t.dtype(), "'"));
    }
    in.desc.dtype = *dtype;
    WPUB_ASSIGN_OR_RETURN(in.desc.shape,
                          ShapeFromProto(t.shape(), absl::StrCat("tensor '", t.name(), "'")));
    if (t.concat_dim() > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name(), "': concat_dim must be 0 or 1, got ", t.concat_dim()));
    }
    in.concat_dim = static_cast<int>(t.concat_dim());
    if (t.parts_size() == 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name(), "': no parts"));
    }
    for (int i = 0; i < t.parts_size(); ++i) {
      WPUB_ASSIGN_OR_RETURN(engine::TensorPart part, PartFromProto(t.parts(i), t.name(), i));
      in.parts.push_back(std::move(part));
    }
    out.tensors.push_back(std::move(in));
  }
  return out;
}

void ToProto(const transport::ReceiverOutcome& o, pb::ReceiverOutcome* out) {
  out->set_name(o.name);
  out->set_state(transport::ReceiverStateName(o.state));
  out->set_error(o.error);
  out->set_committed(o.committed);
  out->set_failure(transport::ReceiverFailureName(o.failure));
  out->set_dirty(o.dirty);
  out->set_family(o.family);
  if (o.pause.paused) {
    pb::PauseWindow* w = out->mutable_pause();
    w->set_seconds(o.pause.seconds);
    w->set_waiting(o.pause.waiting);
    w->set_transfer(o.pause.transfer);
    w->set_finalization(o.pause.finalization);
    w->set_resumed(o.pause.resumed);
  }
}

void ToProto(const engine::ReplayReport& r, pb::ReplayReport* out) {
  out->set_kind(engine::ReplayKindName(r.kind));
  out->set_version(r.version);
  out->set_trigger(r.trigger);
  out->set_completed(r.completed);
  out->set_preempted(r.preempted);
  out->set_error(r.error);
  out->set_start_unix_nanos(UnixNanos(r.started_at));
  out->set_seconds(r.seconds);
  out->set_bytes(r.bytes);
  out->set_buckets(r.buckets);
  for (const transport::ReceiverOutcome& o : r.receivers) ToProto(o, out->add_receivers());
}

void ToProto(const engine::PublicationReport& r, pb::PublicationReport* out) {
  out->set_status(StatusToProto(r.status));
  out->set_version(r.version);
  out->set_error_code(static_cast<int32_t>(r.code));
  out->set_error_message(r.error);
  out->set_model_id(r.model_id);
  out->set_recipe(r.recipe);
  out->set_wall_seconds(r.wall_seconds);
  ToProto(r.phases, out->mutable_phases());
  out->set_host_syncs(r.host_syncs);
  out->set_bytes_in(r.bytes_in);
  out->set_bytes_out(r.bytes_out);
  for (const auto& [format, bytes] : r.bytes_out_by_format) {
    (*out->mutable_bytes_out_by_format())[format] = bytes;
  }
  out->set_non_finite(r.non_finite);
  out->mutable_tensors()->set_quantized(r.tensors_quantized);
  out->mutable_tensors()->set_passthrough(r.tensors_passthrough);
  out->mutable_tensors()->set_ignored(r.tensors_ignored);
  for (const transport::ReceiverOutcome& o : r.receivers) ToProto(o, out->add_receivers());
  out->set_start_unix_nanos(UnixNanos(r.started_at));
  out->set_num_buckets(r.buckets);
  out->set_attempts(r.attempts);
  for (const std::string& e : r.retry_errors) out->add_retry_errors(e);
  if (r.group.has_value()) ToProto(*r.group, out->mutable_group());
}

void ToProto(const engine::EngineStatus& s, pb::GetStatusResponse* out) {
  out->set_committed_version(s.committed_version);
  if (s.active) {
    pb::ActivePublication* a = out->mutable_active();
    a->set_version(s.active->version);
    a->set_state(engine::PublicationStateName(s.active->state));
    a->set_model_id(s.active->model_id);
    a->set_age_seconds(absl::ToDoubleSeconds(absl::Now() - s.active->opened_at));
  }
  for (const transport::ReceiverInfo& r : s.receivers) {
    pb::ReceiverInfo* ri = out->add_receivers();
    ri->set_name(r.name);
    ri->set_state(transport::ReceiverStateName(r.state));
    ri->set_transport("pull");
    ri->set_last_committed_version(r.last_committed_version);
    ri->set_held_version(r.state == transport::ReceiverState::kDirty ? 0 : r.held_version);
  }
  for (const engine::PublicationReport& r : s.last_reports) ToProto(r, out->add_recent_reports());
  out->set_serving(!s.shutting_down);
  out->set_backend(s.backend);
  pb::RetainedCopy* retained = out->mutable_retained();
  retained->set_where(transport::RetainWhereName(s.retained.where));
  retained->set_version(s.retained.version);
  retained->set_bytes(s.retained.bytes);
  retained->set_buckets(s.retained.buckets);
  retained->set_max_bytes(s.retained.max_bytes);
  retained->set_over_bound(s.retained.over_bound);
  retained->set_held_bytes(s.retained.held_bytes);
  retained->set_reason(s.retained.reason);
  for (const engine::ReplayReport& r : s.last_replays) ToProto(r, out->add_recent_replays());
}

absl::StatusOr<engine::RolloutConnectRequest> FromProto(const pb::ConnectEnginesRequest& request) {
  engine::RolloutConnectRequest r;
  for (int i = 0; i < request.engines_size(); ++i) {
    const pb::EngineEndpoint& e = request.engines(i);
    absl::StatusOr<std::pair<std::string, std::string>> split = engine::SplitEngineFamily(e.url());
    if (!split.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("engines[", i, "]: ", split.status().message()));
    }
    std::string family = e.kind();
    if (!split->first.empty()) {
      if (!family.empty() && family != split->first) {
        return absl::InvalidArgumentError(absl::StrCat("engines[", i, "]: kind '", family,
                                                       "' but the URL says '", split->first, "'"));
      }
      family = split->first;
    }
    r.engines.push_back({split->second, e.gpus() == 0 ? 1 : e.gpus(), family});
  }
  r.group_name = request.group_name();
  const double t = request.timeout_seconds();
  if (!(t >= 0) || t > 86400) {  // also NaN
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_seconds ", t, " is not in [0, 86400] (0: the daemon's default)"));
  }
  r.timeout = absl::Seconds(t);
  if (request.has_pause()) {
    absl::StatusOr<engine::PausePolicy> pause =
        engine::PausePolicyOf(request.pause().in_flight(), request.pause().cache());
    if (!pause.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("pause: ", pause.status().message()));
    }
    r.pause = *pause;
  }
  return r;
}

namespace {

void EnginesToProto(const engine::RolloutGroupInfo& g,
                    google::protobuf::RepeatedPtrField<pb::ConnectedEngine>* out) {
  for (const engine::RolloutEngineInfo& e : g.engines) {
    pb::ConnectedEngine* c = out->Add();
    c->set_url(e.url);
    c->set_gpus(static_cast<uint32_t>(e.gpus));
    c->set_rank_offset(static_cast<uint32_t>(e.rank_offset));
    c->set_state(transport::ReceiverStateName(e.state));
    c->set_pause(engine::PausePolicyName(e.pause));
  }
}

}  // namespace

void ToProto(const engine::RolloutGroupInfo& g, pb::EngineGroup* out) {
  out->set_group_name(g.group_name);
  out->set_world_size(static_cast<uint32_t>(g.world_size));
  EnginesToProto(g, out->mutable_engines());
  out->set_generation(g.generation);
  out->set_healthy(g.healthy);
  out->set_store_address(g.store_address);
}

void ToProto(const engine::RolloutGroupInfo& g, pb::ConnectEnginesResponse* out) {
  out->set_group_name(g.group_name);
  out->set_world_size(static_cast<uint32_t>(g.world_size));
  EnginesToProto(g, out->mutable_engines());
  out->set_generation(g.generation);
}

void ToProto(const transport::PublicationManifest& m, pb::Manifest* out) {
  out->set_version(m.version);
  out->set_attempt(m.attempt);
  out->set_model_id(m.model_id);
  out->set_recipe(m.recipe);
  out->set_total_bytes(m.total_bytes());
  if (!m.group.empty()) {
    out->set_group(m.group);
    out->set_group_members(m.group_members);
    out->set_group_member(m.group_member);
  }
  for (const transport::BucketManifest& b : m.buckets) {
    pb::BucketManifest* bm = out->add_buckets();
    bm->set_index(b.index);
    bm->set_nbytes(b.nbytes);
    bm->set_checksum(b.checksum);
    for (const transport::ManifestTensor& t : b.tensors)
      ManifestTensorToProto(t, bm->add_tensors());
  }
}

void ToProto(const transport::ReceiverEvent& event, pb::ReceiverEvent* out) {
  std::visit(
      [out](const auto& e) {
        using T = std::decay_t<decltype(e)>;
        if constexpr (std::is_same_v<T, transport::GroupInfoEvent>) {
          pb::GroupInfo* g = out->mutable_group_info();
          g->set_receiver_name(e.receiver_name);
          g->set_transport(e.transport);
          g->set_committed_version(e.committed_version);
          g->set_subscription_token(e.subscription_token);
          switch (e.staged) {
            case transport::StagedDecision::kUnknown:
              g->set_staged(pb::GroupInfo::STAGED_UNKNOWN);
              break;
            case transport::StagedDecision::kApply:
              g->set_staged(pb::GroupInfo::STAGED_APPLY);
              break;
            case transport::StagedDecision::kDiscard:
              g->set_staged(pb::GroupInfo::STAGED_DISCARD);
              break;
          }
          g->set_staged_reason(e.staged_reason);
        } else if constexpr (std::is_same_v<T, transport::ManifestEvent>) {
          ToProto(e.manifest, out->mutable_manifest());
          out->mutable_manifest()->set_committed_version(e.committed_version);
          out->mutable_manifest()->set_patch_base(e.patch_base);
        } else if constexpr (std::is_same_v<T, transport::BucketReadyEvent>) {
          out->mutable_bucket_ready()->set_version(e.version);
          out->mutable_bucket_ready()->set_index(e.index);
          out->mutable_bucket_ready()->set_attempt(e.attempt);
        } else if constexpr (std::is_same_v<T, transport::CommitEvent>) {
          out->mutable_commit()->set_version(e.version);
        } else {
          static_assert(std::is_same_v<T, transport::AbortEvent>);
          out->mutable_abort()->set_version(e.version);
          out->mutable_abort()->set_reason(e.reason);
          out->mutable_abort()->set_attempt(e.attempt);
        }
      },
      event);
}

absl::StatusOr<transport::PublicationManifest> FromProto(const pb::Manifest& m) {
  transport::PublicationManifest out;
  out.version = m.version();
  out.attempt = m.attempt() == 0 ? 1 : m.attempt();
  out.model_id = m.model_id();
  out.recipe = m.recipe();
  out.group = m.group();
  out.group_members = m.group_members() == 0 ? 1 : m.group_members();
  out.group_member = m.group_member();
  if (out.group_member >= out.group_members || out.group_members > engine::kMaxGroupMembers) {
    return absl::InvalidArgumentError(absl::StrCat("manifest of v", out.version, ": group member ",
                                                   out.group_member, " of ", out.group_members));
  }
  for (const pb::BucketManifest& b : m.buckets()) {
    transport::BucketManifest bm;
    bm.index = b.index();
    bm.nbytes = b.nbytes();
    bm.checksum = b.checksum();
    for (const pb::ManifestTensor& t : b.tensors()) {
      transport::ManifestTensor mt;
      mt.name = t.name();
      absl::StatusOr<DType> dtype = ParseDType(t.dtype());
      if (!dtype.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("manifest tensor '", t.name(), "': unknown dtype '", t.dtype(), "'"));
      }
      mt.dtype = *dtype;
      mt.shape.assign(t.shape().begin(), t.shape().end());
      mt.offset = t.offset();
      mt.nbytes = t.nbytes();
      bm.tensors.push_back(std::move(mt));
    }
    out.buckets.push_back(std::move(bm));
  }
  return out;
}

}  // namespace wpub::wire
