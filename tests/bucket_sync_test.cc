// The storage-bucket path through two real daemons that never talk to each other: the trainer's
// refitd writes the real bf16 versions v000..v003 to a directory (--bucket-export), and an
// engine's refitd follows another directory (--bucket-import) into which the test copies the
// exported files version by version — as an object-store sync would — so that it controls
// exactly what the importer sees: whole versions, a truncated file, a flipped byte. Every
// version that arrives is checked bit for bit on a resharded destination (TP rank 0 of 2).

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/real_model.h"

namespace refit {
namespace {

namespace fs = std::filesystem;
using client::SharedMemory;
using std::chrono::milliseconds;

// A fresh directory, removed at the end.
struct TempDir {
  TempDir() {
    const char* base = std::getenv("TEST_TMPDIR");
    std::string pattern = std::string(base && *base ? base : "/tmp") + "/refit-bucket-XXXXXX";
    path = mkdtemp(pattern.data());
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
  fs::path path;
};

std::vector<fs::path> FilesOf(const fs::path& model_dir, uint64_t version) {
  char prefix[32];
  std::snprintf(prefix, sizeof(prefix), "v%020llu.", static_cast<unsigned long long>(version));
  std::vector<fs::path> out;
  for (const auto& entry : fs::directory_iterator(model_dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) == 0) out.push_back(entry.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Copies version `version` from the exporter's model directory to the importer's, data files
// first and the manifest last, each under a temporary name renamed into place (as the exporter
// itself writes). `edit` may change a data file's bytes on the way.
void Deliver(const fs::path& from, const fs::path& to, uint64_t version,
             const std::function<void(const fs::path&, std::string&)>& edit = nullptr) {
  fs::create_directories(to);
  fs::path manifest;
  for (const fs::path& file : FilesOf(from, version)) {
    if (file.string().find(".manifest.json") != std::string::npos) {
      manifest = file;
      continue;
    }
    std::ifstream in(file, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (edit) edit(file, bytes);
    const fs::path tmp = to / (".tmp.test." + file.filename().string());
    std::ofstream(tmp, std::ios::binary) << bytes;
    fs::rename(tmp, to / file.filename());
  }
  REQUIRE(!manifest.empty());
  const fs::path tmp = to / ".tmp.test.manifest";
  fs::copy_file(manifest, tmp, fs::copy_options::overwrite_existing);
  fs::rename(tmp, to / manifest.filename());
}

TEST_CASE("versions travel through a bucket directory; corrupt files are refused",
          "[integration][bucket]") {
  const testing::Data data = testing::Load();
  REQUIRE_FALSE(data.versions.empty());
  const testing::Engine engine = testing::MakeEngine(data);
  TempDir tmp;
  const fs::path exported = tmp.path / "bucket-out";
  const fs::path followed = tmp.path / "bucket-in";
  // Full bases every second version: full, delta, full, delta.
  auto exporter_node =
      testing::DaemonProcess::Start({"--node=trainer", "--bucket-export=" + exported.string(),
                                     "--bucket-full-every=2", "--retain=4"});
  REQUIRE(exporter_node.ok());
  auto importer_node =
      testing::DaemonProcess::Start({"--node=engine", "--bucket-import=" + followed.string()});
  REQUIRE(importer_node.ok());
  auto trainer = (*exporter_node)->Connect();
  auto client = (*importer_node)->Connect();
  REQUIRE(trainer.ok());
  REQUIRE(client.ok());

  auto source = SharedMemory::Create(testing::UniqueShmName("src"), data.versions[0].size());
  REQUIRE(source.ok());
  auto source_id = (*trainer)->RegisterBuffer("tiny-llama", v1::SOURCE, source->name(),
                                              testing::SourceSlices(data));
  REQUIRE(source_id.ok());
  auto dest = SharedMemory::Create(testing::UniqueShmName("dst"), engine.bytes);
  REQUIRE(dest.ok());
  auto dest_id =
      (*client)->RegisterBuffer("tiny-llama", v1::DESTINATION, dest->name(), engine.slices);
  REQUIRE(dest_id.ok());

  // The exporter writes every version; wait for each manifest.
  for (size_t v = 0; v < data.versions.size(); ++v) {
    std::memcpy(source->data(), data.versions[v].data(), data.versions[v].size());
    auto published = (*trainer)->Publish("tiny-llama", v + 1, {*source_id});
    INFO("version " << v + 1 << ": " << published.status().ToString());
    REQUIRE(published.ok());
    for (int i = 0; i < 400; ++i) {
      if (testing::Metric(**trainer, "refit_bucket_versions_exported_total") >= v + 1) break;
      std::this_thread::sleep_for(milliseconds(25));
    }
  }
  REQUIRE(testing::Metric(**trainer, "refit_bucket_versions_exported_total") == 4);
  fs::path model_dir;
  for (const auto& entry : fs::directory_iterator(exported)) model_dir = entry.path();
  REQUIRE(!model_dir.empty());
  const fs::path into = followed / model_dir.filename();
  // What the exporter chose: full, delta, full, delta.
  auto has = [&](uint64_t v, const std::string& kind) {
    for (const fs::path& f : FilesOf(model_dir, v)) {
      if (f.string().find(kind) != std::string::npos) return true;
    }
    return false;
  };
  CHECK(has(1, ".full.zst"));
  CHECK(has(2, ".delta"));
  CHECK(has(3, ".full.zst"));
  CHECK(has(4, ".delta"));

  auto receive = [&](uint64_t version) {
    auto got = (*client)->WaitForVersion("tiny-llama", version, milliseconds(30000));
    REQUIRE(got.ok());
    REQUIRE(*got == version);
    std::memset(dest->data(), 0xAB, dest->size());
    REQUIRE((*client)->Apply("tiny-llama", version, {*dest_id}).ok());
    CHECK(testing::CountWrongRuns(engine, dest->data(), data.versions[version - 1]) == 0);
  };
  auto stays_on = [&](uint64_t version, double rejected) {
    for (int i = 0; i < 400; ++i) {
      if (testing::Metric(**client, "refit_bucket_rejected_total") >= rejected) break;
      std::this_thread::sleep_for(milliseconds(25));
    }
    CHECK(testing::Metric(**client, "refit_bucket_rejected_total") == rejected);
    auto got = (*client)->WaitForVersion("tiny-llama", version + 1, milliseconds(300));
    CHECK(got.status().code() == absl::StatusCode::kDeadlineExceeded);
    auto status = (*client)->Status();
    REQUIRE(status.ok());
    CHECK(status->models(0).latest_version() == version);
  };

  Deliver(model_dir, into, 1);
  receive(1);
  Deliver(model_dir, into, 2);  // a delta on version 1
  receive(2);
  // Version 3's full file arrives cut short: refused, the node stays on 2.
  Deliver(model_dir, into, 3,
          [](const fs::path&, std::string& bytes) { bytes.resize(bytes.size() / 2); });
  stays_on(2, 1);
  Deliver(model_dir, into, 3);  // the sync finishes the file
  receive(3);
  // Version 4's delta has one flipped byte: refused, the node stays on 3.
  Deliver(model_dir, into, 4,
          [](const fs::path&, std::string& bytes) { bytes[bytes.size() / 2] ^= 0x10; });
  stays_on(3, 2);
  Deliver(model_dir, into, 4);
  receive(4);
  CHECK(testing::Metric(**client, "refit_bucket_versions_imported_total") == 4);
}

}  // namespace
}  // namespace refit
