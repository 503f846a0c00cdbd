#include "cuda/device_uuid.h"

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace refit::cuda {
namespace {

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  c = absl::ascii_tolower(static_cast<unsigned char>(c));
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

absl::Status Malformed(const std::string& text, const char* why) {
  return absl::InvalidArgumentError(absl::StrCat(
      "device_uuid \"", absl::CEscape(text.substr(0, 64)), text.size() > 64 ? "..." : "",
      "\" is not a GPU UUID (", why, "; expected e.g. GPU-6b1c9f2e-0d3a-4c7e-9a51-3f0e2d1c4b5a)"));
}

}  // namespace

absl::StatusOr<GpuUuid> ParseGpuUuid(const std::string& text) {
  std::string rest = text;
  if (rest.size() >= 4 && absl::AsciiStrToUpper(rest.substr(0, 4)) == "GPU-") rest = rest.substr(4);
  // Dashes either after hex digits 8, 12, 16 and 20 (the canonical form) or nowhere.
  const bool dashed = rest.size() == 36;
  if (!dashed && rest.size() != 32) return Malformed(text, "wrong length");
  GpuUuid uuid{};
  int digits = 0;
  for (size_t i = 0; i < rest.size(); ++i) {
    if (dashed && (i == 8 || i == 13 || i == 18 || i == 23)) {
      if (rest[i] != '-') return Malformed(text, "a dash missing");
      continue;
    }
    const int value = HexValue(rest[i]);
    if (value < 0) return Malformed(text, "not a hex digit");
    uuid[digits / 2] = static_cast<uint8_t>(uuid[digits / 2] << 4 | value);
    ++digits;
  }
  return uuid;
}

std::string FormatGpuUuid(const GpuUuid& uuid) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "GPU-";
  for (size_t i = 0; i < uuid.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    out += kHex[uuid[i] >> 4];
    out += kHex[uuid[i] & 15];
  }
  return out;
}

}  // namespace refit::cuda
