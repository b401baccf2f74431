// Conversions between the wire messages of proto/wpub/v1 and the core engine's value types
// (core/engine/types.h). The only place where both vocabularies meet; pure functions,
// thread-safe. Errors name the offending field so a trainer sees exactly what it sent wrong.
#pragma once

#include "absl/status/statusor.h"
#include "core/engine/engine.h"
#include "core/engine/types.h"
#include "wpub/v1/publisher.pb.h"
#include "wpub/v1/receivers.pb.h"

namespace wpub::wire {

// Header -> engine header. `precision_exceptions` becomes the policy JSON the core parses.
// Errors: INVALID_ARGUMENT naming `header.<field>` (version 0, ...).
absl::StatusOr<engine::PublicationHeader> FromProto(const wpub::v1::PublicationHeader& header);

// Batch -> engine batch. Errors: INVALID_ARGUMENT naming the tensor (unknown dtype, missing or
// bad part source, concat_dim not 0/1, negative dims, CUDA IPC handle not 64 bytes).
absl::StatusOr<engine::BatchInput> FromProto(const wpub::v1::Batch& batch);

// The precision exceptions as the policy's JSON (empty string when everything is default).
std::string PrecisionExceptionsJson(const wpub::v1::PrecisionExceptions& exceptions);

// Engine report -> wire report.
void ToProto(const engine::PublicationReport& report, wpub::v1::PublicationReport* out);
void ToProto(const transport::ReceiverOutcome& outcome, wpub::v1::ReceiverOutcome* out);
void ToProto(const engine::ReplayReport& report, wpub::v1::ReplayReport* out);
void ToProto(const engine::PhaseSeconds& phases, wpub::v1::PhaseSeconds* out);
engine::PhaseSeconds FromProto(const wpub::v1::PhaseSeconds& phases);
void ToProto(const engine::GroupSummary& group, wpub::v1::GroupSummary* out);
// Engine status -> wire status.
void ToProto(const engine::EngineStatus& status, wpub::v1::GetStatusResponse* out);
// Engine receiver event -> wire event.
void ToProto(const transport::ReceiverEvent& event, wpub::v1::ReceiverEvent* out);
void ToProto(const transport::PublicationManifest& manifest, wpub::v1::Manifest* out);

// ConnectEngines request -> engine request (gpus 0 becomes 1). Errors: INVALID_ARGUMENT
// naming timeout_seconds when it is negative, not finite or beyond a day; the engine validates
// the rest (ValidateRolloutConnectRequest).
absl::StatusOr<engine::RolloutConnectRequest> FromProto(
    const wpub::v1::ConnectEnginesRequest& request);
// The engine group -> GetStatus' engine_group / ConnectEngines' reply.
void ToProto(const engine::RolloutGroupInfo& group, wpub::v1::EngineGroup* out);
void ToProto(const engine::RolloutGroupInfo& group, wpub::v1::ConnectEnginesResponse* out);

// Wire manifest -> engine manifest (receivers decode what the daemon sent).
// Errors: INVALID_ARGUMENT naming the tensor with an unknown dtype.
absl::StatusOr<transport::PublicationManifest> FromProto(const wpub::v1::Manifest& manifest);

}  // namespace wpub::wire
