#include "daemon/common/types.h"

#include <sstream>

namespace refit {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
    case DType::kFP16:
      return 2;
    case DType::kFP32:
    case DType::kINT32:
      return 4;
    case DType::kFP8E4M3:
    case DType::kFP8E5M2:
    case DType::kINT8:
    case DType::kUINT8:
      return 1;
    case DType::kINT64:
      return 8;
    case DType::kUnspecified:
      break;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kFP16:
      return "fp16";
    case DType::kFP32:
      return "fp32";
    case DType::kFP8E4M3:
      return "fp8_e4m3";
    case DType::kFP8E5M2:
      return "fp8_e5m2";
    case DType::kINT8:
      return "int8";
    case DType::kUINT8:
      return "uint8";
    case DType::kINT32:
      return "int32";
    case DType::kINT64:
      return "int64";
    case DType::kUnspecified:
      break;
  }
  return "unspecified";
}

bool IsFloat(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
    case DType::kFP16:
    case DType::kFP32:
    case DType::kFP8E4M3:
    case DType::kFP8E5M2:
      return true;
    default:
      return false;
  }
}

const char* RoleName(Role role) {
  switch (role) {
    case Role::kSource:
      return "source";
    case Role::kDestination:
      return "destination";
    case Role::kUnspecified:
      break;
  }
  return "unspecified";
}

uint64_t TensorSlice::NumElements() const {
  uint64_t n = 1;
  for (int64_t s : sizes) n *= static_cast<uint64_t>(s);
  return n;
}

bool TensorSlice::IsContiguous() const {
  int64_t expected = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    if (sizes[d] != 1 && buffer_strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

std::string BoxString(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes) {
  std::ostringstream out;
  out << "[";
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (d) out << ", ";
    out << offsets[d] << ":" << offsets[d] + sizes[d];
  }
  out << "]";
  return out.str();
}

}  // namespace refit
