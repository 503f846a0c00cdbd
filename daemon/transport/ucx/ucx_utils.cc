#include "daemon/transport/ucx/ucx_utils.h"

#include "absl/strings/str_cat.h"

namespace refit::transport::ucx {

bool IsPeerFailure(ucs_status_t status) {
  switch (status) {
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_REJECTED:
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_SHMEM_SEGMENT:
      return true;
    default:
      return UCS_IS_LINK_ERROR(status) || UCS_IS_ENDPOINT_ERROR(status);
  }
}

absl::Status ToStatus(ucs_status_t status, std::string_view what) {
  if (status == UCS_OK) return absl::OkStatus();
  std::string message = absl::StrCat(std::string(what), ": ", ucs_status_string(status));
  if (IsPeerFailure(status)) return absl::UnavailableError(message);
  switch (status) {
    case UCS_ERR_CANCELED:
      return absl::CancelledError(message);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
    case UCS_ERR_OUT_OF_RANGE:
    case UCS_ERR_MESSAGE_TRUNCATED:
    case UCS_ERR_BUFFER_TOO_SMALL:
      return absl::InvalidArgumentError(message);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      return absl::ResourceExhaustedError(message);
    case UCS_ERR_UNSUPPORTED:
    case UCS_ERR_NOT_IMPLEMENTED:
      return absl::UnimplementedError(message);
    case UCS_ERR_NO_DEVICE:
    case UCS_ERR_NO_ELEM:
      return absl::FailedPreconditionError(message);
    case UCS_ERR_BUSY:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace refit::transport::ucx
