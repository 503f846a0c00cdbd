#pragma once

// Conversions between refit.v1 protobuf messages and the daemon's domain types, and between
// absl::Status and grpc::Status. The only place where the two worlds meet.

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/common/types.h"
#include "daemon/store/store_types.h"
#include "grpcpp/grpcpp.h"
#include "proto/refit/v1/refit.pb.h"

namespace refit::convert {

// INVALID_ARGUMENT for an unknown dtype value.
absl::StatusOr<TensorSlice> FromProto(const v1::TensorSlice& slice);
// The same without the dtype check, for slices a peer daemon already validated.
TensorSlice FromTrustedProto(const v1::TensorSlice& slice);
absl::StatusOr<std::vector<TensorSlice>> FromProto(
    const google::protobuf::RepeatedPtrField<v1::TensorSlice>& slices);

void ToProto(const TensorSlice& slice, v1::TensorSlice* out);
void ToProto(const ModelInfo& info, v1::ModelStatus* out);

grpc::Status ToGrpc(const absl::Status& status);

// The remaining time of a call as a steady-clock deadline (far future when it has none).
Clock::time_point SteadyDeadline(const grpc::ServerContext& context);

}  // namespace refit::convert
