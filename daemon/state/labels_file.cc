#include "daemon/state/labels_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "nlohmann/json.hpp"

namespace refit::state {
namespace {

constexpr char kFormat[] = "refit-labels";
constexpr int kFormatVersion = 1;

uint64_t Fnv1a(const std::string& text) {
  uint64_t hash = 1469598103934665603ull;
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  return hash;
}

absl::Status WriteFile(const std::string& path, const std::string& text) {
  const std::string temp = absl::StrCat(path, ".tmp.", getpid());
  const int fd = open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0640);
  if (fd < 0) return absl::InternalError(absl::StrCat(temp, ": ", std::strerror(errno)));
  size_t done = 0;
  absl::Status written;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      written = absl::InternalError(std::strerror(errno));
      break;
    }
    done += static_cast<size_t>(n);
  }
  if (written.ok() && fsync(fd) != 0) written = absl::InternalError(std::strerror(errno));
  close(fd);
  if (written.ok() && rename(temp.c_str(), path.c_str()) != 0) {
    written = absl::InternalError(std::strerror(errno));
  }
  if (!written.ok()) {
    unlink(temp.c_str());
    return absl::InternalError(absl::StrCat(path, ": ", written.message()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<LabelsFile>> LabelsFile::Open(const std::string& dir) {
  const std::string labels_dir = (std::filesystem::path(dir) / "labels").string();
  std::error_code ec;
  std::filesystem::create_directories(labels_dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("--state-dir: cannot create ", labels_dir, ": ", ec.message()));
  }
  return std::unique_ptr<LabelsFile>(new LabelsFile(labels_dir));
}

std::string LabelsFile::PathOf(const std::string& model) const {
  std::string stem;
  for (char c : model.substr(0, 64)) {
    const bool plain = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                       c == '.' || c == '_' || c == '-';
    stem.push_back(plain ? c : '_');
  }
  if (!stem.empty() && stem[0] == '.') stem[0] = '_';
  return (std::filesystem::path(dir_) /
          absl::StrCat(stem, "-", absl::Hex(Fnv1a(model), absl::kZeroPad16), ".json"))
      .string();
}

LabelsFile::Loaded LabelsFile::Load() const {
  Loaded out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    const std::string path = entry.path().string();
    if (entry.path().extension() != ".json") {
      // a temporary file a crash left behind
      if (path.find(".json.tmp.") != std::string::npos) std::filesystem::remove(path, ec);
      continue;
    }
    auto skip = [&](const std::string& why) {
      out.skipped.push_back(absl::StrCat(path, ": ", why));
    };
    std::ifstream in(path);
    if (!in) {
      skip("cannot read it");
      continue;
    }
    std::stringstream text;
    text << in.rdbuf();
    const nlohmann::json json =
        nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
    if (json.is_discarded() || !json.is_object()) {
      skip("not JSON");
      continue;
    }
    if (json.value("format", "") != kFormat || !json.contains("format_version") ||
        !json["format_version"].is_number_integer() ||
        json["format_version"].get<int>() != kFormatVersion) {
      skip("not a refit-labels file of format_version 1");
      continue;
    }
    if (!json.contains("model") || !json["model"].is_string() ||
        json["model"].get<std::string>().empty() || !json.contains("versions") ||
        !json["versions"].is_object()) {
      skip("no model name or no versions object");
      continue;
    }
    std::map<uint64_t, rl::Labels> versions;
    bool valid = true;
    for (const auto& [number, labels] : json["versions"].items()) {
      uint64_t version = 0;
      if (!absl::SimpleAtoi(number, &version) || version == 0 || !labels.is_object()) {
        valid = false;
        break;
      }
      rl::Labels& kept = versions[version];
      for (const auto& [key, value] : labels.items()) {
        if (!value.is_string()) {
          valid = false;
          break;
        }
        kept[key] = value.get<std::string>();
      }
      if (!valid || !rl::CheckLabels(kept).ok()) {
        valid = false;
        break;
      }
    }
    if (!valid) {
      skip("a version that is not a number >= 1 with at most 1 KiB of string labels");
      continue;
    }
    out.models[json["model"].get<std::string>()] = std::move(versions);
  }
  return out;
}

void LabelsFile::Save(const std::string& model, const std::map<uint64_t, rl::Labels>& versions) {
  const std::string path = PathOf(model);
  if (versions.empty()) {
    std::error_code ec;
    std::filesystem::remove(path, ec);
    return;
  }
  nlohmann::json json;
  json["format"] = kFormat;
  json["format_version"] = kFormatVersion;
  json["model"] = model;
  json["versions"] = nlohmann::json::object();
  for (const auto& [version, labels] : versions) {
    json["versions"][std::to_string(version)] = labels;
  }
  const absl::Status written =
      WriteFile(path, json.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
  if (!written.ok()) {
    Logger("daemon")->warn("labels of model {} not kept across restarts: {}", model,
                           written.ToString());
  }
}

}  // namespace refit::state
