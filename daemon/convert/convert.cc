#include "daemon/convert/convert.h"

#include <chrono>

#include "absl/strings/str_cat.h"

namespace refit::convert {

absl::StatusOr<TensorSlice> FromProto(const v1::TensorSlice& in) {
  if (!v1::DType_IsValid(in.dtype())) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", in.name(), ": unknown dtype ", in.dtype()));
  }
  return FromTrustedProto(in);
}

void ToProto(const TensorSlice& in, v1::TensorSlice* out) {
  out->set_name(in.name);
  out->set_dtype(static_cast<v1::DType>(in.dtype));
  for (int64_t d : in.global_shape) out->add_global_shape(d);
  for (int64_t d : in.offsets) out->add_offsets(d);
  for (int64_t d : in.sizes) out->add_sizes(d);
  out->set_buffer_offset(in.buffer_offset);
  for (int64_t d : in.buffer_strides) out->add_buffer_strides(d);
  out->set_scale_tensor(in.scale_tensor);
  for (int64_t d : in.scale_block) out->add_scale_block(d);
}

TensorSlice FromTrustedProto(const v1::TensorSlice& in) {
  TensorSlice out;
  out.name = in.name();
  out.dtype = static_cast<DType>(in.dtype());
  out.global_shape.assign(in.global_shape().begin(), in.global_shape().end());
  out.offsets.assign(in.offsets().begin(), in.offsets().end());
  out.sizes.assign(in.sizes().begin(), in.sizes().end());
  out.buffer_offset = in.buffer_offset();
  out.buffer_strides.assign(in.buffer_strides().begin(), in.buffer_strides().end());
  out.scale_tensor = in.scale_tensor();
  out.scale_block.assign(in.scale_block().begin(), in.scale_block().end());
  return out;
}

absl::StatusOr<std::vector<TensorSlice>> FromProto(
    const google::protobuf::RepeatedPtrField<v1::TensorSlice>& slices) {
  std::vector<TensorSlice> out;
  out.reserve(slices.size());
  for (const auto& s : slices) {
    auto converted = FromProto(s);
    if (!converted.ok()) return converted.status();
    out.push_back(std::move(converted).value());
  }
  return out;
}

void ToProto(const ModelInfo& info, v1::ModelStatus* out) {
  out->set_model(info.name);
  out->set_latest_version(info.latest_version);
  for (uint64_t v : info.versions) out->add_versions(v);
  out->set_source_buffers(info.source_buffers);
  out->set_destination_buffers(info.destination_buffers);
  out->set_version_bytes(info.version_bytes);
  out->set_abandoned_version(info.abandoned_version);
  out->set_abandoned_error(info.abandoned_error);
  out->set_skipped_version(info.skipped_version);
  out->set_skipped_reason(info.skipped_reason);
  out->set_latest_nonfinite_values(info.latest_nonfinite_values);
  out->set_held_bytes(info.held_bytes);
  out->set_spare_bytes(info.spare_bytes);
  out->set_in_flight_bytes(info.in_flight_bytes);
  out->set_share_bytes(info.share_bytes);
  out->set_budget_bytes(info.budget_bytes);
  out->set_memory_warning(info.memory_warning);
  out->set_delta_base(info.delta_base);
  out->set_destination_base_version(info.destination_base_version);
  out->set_delta_base_note(info.delta_base_note);
  out->set_run(info.run);
  for (const std::string& r : info.past_runs) out->add_past_runs(r);
  out->set_rollback_version(info.rollback_version);
  for (const BufferInfo& b : info.buffers) {
    v1::BufferStatus* bs = out->add_buffers();
    bs->set_buffer_id(b.id);
    bs->set_role(static_cast<v1::Role>(b.role));
    bs->set_client(b.client);
    bs->set_bytes(b.bytes);
    bs->set_tensors(b.tensors);
    bs->set_last_published_version(b.last_published);
    bs->set_memory(MemoryKindName(b.memory));
    bs->set_error(b.error);
    bs->set_applied_version(b.applied_version);
  }
}

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbering. Messages quote names from the request;
  // a long one is cut so that the reply stays within what clients accept as metadata (8 KiB
  // by default, beyond which the caller would see RESOURCE_EXHAUSTED instead of our code).
  constexpr size_t kMaxMessage = 1024;
  std::string message(status.message());
  if (message.size() > kMaxMessage) {
    const size_t cut = message.size() - kMaxMessage;
    message.resize(kMaxMessage);
    absl::StrAppend(&message, "... (", cut, " more bytes)");
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), message);
}

Clock::time_point SteadyDeadline(const grpc::ServerContext& context) {
  const auto remaining = context.deadline() - std::chrono::system_clock::now();
  const auto far = std::chrono::hours(24 * 365);
  if (remaining > far) return Clock::now() + far;
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(remaining);
}

}  // namespace refit::convert
