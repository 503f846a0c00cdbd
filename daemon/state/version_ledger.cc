#include "daemon/state/version_ledger.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace refit::state {
namespace {

constexpr char kFormat[] = "refit-state";
constexpr int kFormatVersion = 1;

absl::Status WriteAll(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::InternalError(std::strerror(errno));
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<VersionLedger>> VersionLedger::Open(const std::string& dir) {
  if (dir.empty()) return std::unique_ptr<VersionLedger>(new VersionLedger(""));
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("--state-dir=", dir, ": cannot create it: ", ec.message()));
  }
  // A directory refitd can't write (a read-only file system, another owner, a full disk) is
  // found now, at start, rather than at the first Publish.
  {
    const std::string probe = (std::filesystem::path(dir) / ".write-probe").string();
    const int fd = open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    absl::Status wrote =
        fd < 0 ? absl::InternalError(std::strerror(errno)) : WriteAll(fd, std::string(4096, '\0'));
    if (wrote.ok() && fd >= 0 && fsync(fd) != 0) wrote = absl::InternalError(std::strerror(errno));
    if (fd >= 0) close(fd);
    unlink(probe.c_str());
    if (!wrote.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--state-dir=", dir, ": cannot write there (", wrote.message(),
          "): a read-only or full file system, or a directory the daemon's user does not own; "
          "each model's newest version could not be remembered across restarts"));
    }
  }
  const std::string path = (std::filesystem::path(dir) / "state.json").string();
  std::unique_ptr<VersionLedger> ledger(new VersionLedger(path));
  std::ifstream in(path);
  if (!in) {
    if (std::filesystem::exists(path, ec)) {
      return absl::FailedPreconditionError(absl::StrCat("--state-dir: cannot read ", path));
    }
    return ledger;  // a fresh directory
  }
  std::stringstream text;
  text << in.rdbuf();
  auto invalid = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--state-dir: ", path, " is not a valid refit state file (", why,
        "); refitd will not guess what it held: move it away to start fresh (each model's "
        "newest published version is then forgotten, so make sure trainers publish numbers "
        "above the ones their engines hold)"));
  };
  const nlohmann::json json =
      nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return invalid("not JSON");
  if (!json.is_object() || json.value("format", "") != kFormat) {
    return invalid("no \"format\": \"refit-state\"");
  }
  if (!json.contains("format_version") || !json["format_version"].is_number_integer() ||
      json["format_version"].get<int>() != kFormatVersion) {
    return invalid(absl::StrCat("format_version is not ", kFormatVersion));
  }
  if (!json.contains("models") || !json["models"].is_object()) return invalid("no models object");
  common::MutexLock lock(ledger->mu_);  // not shared yet; the analysis asks for it
  for (const auto& [name, entry] : json["models"].items()) {
    const bool held = entry.is_object() && entry.contains("hold") &&
                      entry["hold"].is_number_unsigned() && entry["hold"].get<uint64_t>() > 0;
    if (name.empty() || !entry.is_object() || !entry.contains("newest_published") ||
        !entry["newest_published"].is_number_unsigned() ||
        (entry["newest_published"].get<uint64_t>() == 0 && !held)) {
      return invalid(
          absl::StrCat("model '", name.substr(0, 64), "' has no newest_published version >= 1"));
    }
    if (entry.contains("hold") && !entry["hold"].is_number_unsigned()) {
      return invalid(absl::StrCat("model '", name.substr(0, 64), "': hold is not a version"));
    }
    Entry& e = ledger->models_[name];
    e.newest = entry["newest_published"].get<uint64_t>();
    if (held) e.hold = entry["hold"].get<uint64_t>();
    // The trainer's run (PublishRequest.run) and the runs left: optional keys.
    if (entry.contains("run")) {
      if (!entry["run"].is_string())
        return invalid(absl::StrCat("model '", name.substr(0, 64), "': run is not a string"));
      e.run = entry["run"].get<std::string>();
    }
    if (entry.contains("past_runs")) {
      if (!entry["past_runs"].is_array()) {
        return invalid(absl::StrCat("model '", name.substr(0, 64), "': past_runs is not a list"));
      }
      for (const auto& r : entry["past_runs"]) {
        if (!r.is_string()) {
          return invalid(
              absl::StrCat("model '", name.substr(0, 64), "': a past run is not a string"));
        }
        e.past_runs.push_back(r.get<std::string>());
      }
    }
  }
  return ledger;
}

absl::Status VersionLedger::Check(const std::string& model, uint64_t version,
                                  const std::string& run) const {
  common::MutexLock lock(mu_);
  auto it = models_.find(model);
  if (it == models_.end()) return absl::OkStatus();
  const Entry& entry = it->second;
  if (!run.empty() && run != entry.run) {
    if (std::find(entry.past_runs.begin(), entry.past_runs.end(), run) != entry.past_runs.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("model ", model, ": run ", run, " was replaced by run ", entry.run,
                       " on this node; publish under the current run or a new one"));
    }
    return absl::OkStatus();  // a new run: its numbers may restart
  }
  if (version > entry.newest || (version == entry.newest && entry.this_process)) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "model ", model, ": version ", version, " was already used: the newest published for it ",
      "on this node is ", entry.newest,
      path_.empty() ? std::string() : absl::StrCat(" (remembered across restarts in ", path_, ")"),
      "; engines' nodes hold that number already and would skip this one. Publish ",
      entry.newest + 1,
      " or later (resume the step count), or name a new run (PublishRequest.run: ",
      "a resume from a checkpoint), whose versions engines follow even below ", entry.newest,
      ", or start over at 1 with `refitctl drop ", model, "` once no buffer of it is registered"));
}

absl::Status VersionLedger::Record(const std::string& model, uint64_t version,
                                   const std::string& run) {
  common::MutexLock lock(mu_);
  Entry& entry = models_[model];
  if (!run.empty() && run != entry.run) {
    // A new run: its numbers start over.
    if (!entry.run.empty()) {
      entry.past_runs.erase(std::remove(entry.past_runs.begin(), entry.past_runs.end(), run),
                            entry.past_runs.end());
      entry.past_runs.push_back(entry.run);
      while (entry.past_runs.size() > kMaxPastRuns) entry.past_runs.erase(entry.past_runs.begin());
    }
    entry.run = run;
    entry.newest = version;
    entry.this_process = true;
    return Save();
  }
  if (version < entry.newest) return absl::OkStatus();
  const bool changed = version != entry.newest;
  entry.newest = version;
  entry.this_process = true;
  return changed ? Save() : absl::OkStatus();
}

absl::StatusOr<uint64_t> VersionLedger::Forget(const std::string& model) {
  common::MutexLock lock(mu_);
  auto it = models_.find(model);
  if (it == models_.end()) return 0;
  const uint64_t newest = it->second.newest;
  models_.erase(it);
  absl::Status saved = Save();
  if (!saved.ok()) return saved;
  return newest;
}

std::string VersionLedger::Run(const std::string& model) const {
  common::MutexLock lock(mu_);
  auto it = models_.find(model);
  return it == models_.end() ? "" : it->second.run;
}

std::vector<std::string> VersionLedger::PastRuns(const std::string& model) const {
  common::MutexLock lock(mu_);
  auto it = models_.find(model);
  return it == models_.end() ? std::vector<std::string>() : it->second.past_runs;
}

absl::Status VersionLedger::RecordHold(const std::string& model, uint64_t version) {
  common::MutexLock lock(mu_);
  auto it = models_.find(model);
  if (it == models_.end()) {
    if (version == 0) return absl::OkStatus();
    it = models_.emplace(model, Entry()).first;
  }
  if (it->second.hold == version) return absl::OkStatus();
  it->second.hold = version;
  if (version == 0 && it->second.newest == 0) models_.erase(it);  // held back here only
  return Save();
}

std::map<std::string, uint64_t> VersionLedger::Holds() const {
  common::MutexLock lock(mu_);
  std::map<std::string, uint64_t> out;
  for (const auto& [name, entry] : models_) {
    if (entry.hold != 0) out[name] = entry.hold;
  }
  return out;
}

uint64_t VersionLedger::Newest(const std::string& model) const {
  common::MutexLock lock(mu_);
  auto it = models_.find(model);
  return it == models_.end() ? 0 : it->second.newest;
}

absl::Status VersionLedger::Save() const {
  if (path_.empty()) return absl::OkStatus();
  nlohmann::json json;
  json["format"] = kFormat;
  json["format_version"] = kFormatVersion;
  json["models"] = nlohmann::json::object();
  for (const auto& [name, entry] : models_) {
    json["models"][name] = {{"newest_published", entry.newest}};
    if (!entry.run.empty()) json["models"][name]["run"] = entry.run;
    if (!entry.past_runs.empty()) json["models"][name]["past_runs"] = entry.past_runs;
    if (entry.hold != 0) json["models"][name]["hold"] = entry.hold;
  }
  const std::string text =
      json.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  const std::string temp = absl::StrCat(path_, ".tmp.", getpid());
  const int fd = open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0640);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("cannot write ", temp, ": ", std::strerror(errno)));
  }
  absl::Status written = WriteAll(fd, text);
  if (written.ok() && fsync(fd) != 0) written = absl::InternalError(std::strerror(errno));
  close(fd);
  if (written.ok() && rename(temp.c_str(), path_.c_str()) != 0) {
    written = absl::InternalError(std::strerror(errno));
  }
  if (!written.ok()) {
    unlink(temp.c_str());
    return absl::InternalError(absl::StrCat("cannot write ", path_, ": ", written.message()));
  }
  // The rename itself must survive a crash too.
  const int dir = open(std::filesystem::path(path_).parent_path().c_str(), O_RDONLY | O_CLOEXEC);
  if (dir >= 0) {
    (void)fsync(dir);
    close(dir);
  }
  return absl::OkStatus();
}

}  // namespace refit::state
