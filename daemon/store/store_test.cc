#include "daemon/store/store.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "catch2/catch.hpp"
#include "daemon/store/store_testing.h"

namespace refit {
namespace {

StoreOptions TestOptions(const std::string& node) {
  StoreOptions options;
  options.retain = 2;
  options.max_spare_slot_bytes = 1ull << 30;
  options.node = node;
  return options;
}

using std::chrono::milliseconds;

TensorSlice Whole(const std::string& name, DType dtype, std::vector<int64_t> shape,
                  uint64_t buffer_offset) {
  TensorSlice s;
  s.name = name;
  s.dtype = dtype;
  s.global_shape = std::move(shape);
  s.buffer_offset = buffer_offset;
  return s;
}

TensorSlice Rows(const std::string& name, DType dtype, std::vector<int64_t> shape, int64_t begin,
                 int64_t count, uint64_t buffer_offset) {
  TensorSlice s = Whole(name, dtype, shape, buffer_offset);
  s.offsets.assign(shape.size(), 0);
  s.offsets[0] = begin;
  s.sizes = shape;
  s.sizes[0] = count;
  return s;
}

// A host region of `size` bytes the test can read and write, lent to the store.
struct TestBuffer {
  explicit TestBuffer(uint64_t size) {
    auto region = AllocateHost(size);
    REQUIRE(region.ok());
    owned = std::move(region).value();
    data = owned->data();
  }
  // Hands the store a second mapping-like view: the store owns `owned` afterwards.
  std::unique_ptr<Region> Lend() { return std::move(owned); }
  std::unique_ptr<Region> owned;
  uint8_t* data;
};

Clock::time_point In(int ms) { return Clock::now() + milliseconds(ms); }

struct Fixture {
  Metrics metrics;
  testing::SnapshotReader snapshot_reader;  // added by the tests that need local snapshots
  Store store{TestOptions("test"), &metrics};
};

TEST_CASE_METHOD(Fixture, "publish then apply copies a version bit-exact", "[store]") {
  TestBuffer src(64 * 4 + 32 * 2);
  TestBuffer dst(64 * 4 + 32 * 2);
  for (int i = 0; i < 64 * 4 + 32 * 2; ++i) src.data[i] = static_cast<uint8_t>(i * 13 + 1);
  auto src_id = store.RegisterBuffer(
      "m", Role::kSource, src.Lend(),
      {Whole("a", DType::kFP32, {8, 8}, 0), Whole("b", DType::kBF16, {32}, 256)}, "trainer");
  REQUIRE(src_id.ok());
  // The destination holds the tensors in the other order.
  auto dst_id = store.RegisterBuffer(
      "m", Role::kDestination, dst.Lend(),
      {Whole("b", DType::kBF16, {32}, 0), Whole("a", DType::kFP32, {8, 8}, 64)}, "engine");
  REQUIRE(dst_id.ok());

  auto published = store.Publish("m", 1, {*src_id});
  REQUIRE(published.ok());
  CHECK(published->bytes == 320);
  auto applied = store.Apply("m", 0, {*dst_id});
  REQUIRE(applied.ok());
  CHECK(applied->version == 1);
  CHECK(applied->bytes_written == 320);
  CHECK(std::memcmp(dst.data, src.data + 256, 64) == 0);
  CHECK(std::memcmp(dst.data + 64, src.data, 256) == 0);
  CHECK(metrics.Get(kVersionsCompleted) == 1);
  CHECK(metrics.Get(kApplyBytes) == 320);
}

TEST_CASE_METHOD(Fixture, "Publish snapshots many small buffers at once, each hashed as itself",
                 "[store]") {
  // 40 buffers of 1 MiB: under common::kParallelBytes each, 40 MiB in all, so several go at
  // once. Every buffer's piece holds its own bytes and their chunk sums.
  store.AddListener(&snapshot_reader);
  constexpr uint64_t kSize = 1 << 20;
  constexpr int kBuffers = 40;
  std::vector<std::unique_ptr<TestBuffer>> srcs;
  std::vector<std::string> ids;
  for (int b = 0; b < kBuffers; ++b) {
    srcs.push_back(std::make_unique<TestBuffer>(kSize));
    for (uint64_t i = 0; i < kSize; ++i) srcs[b]->data[i] = static_cast<uint8_t>(i * 31 + b * 7);
    auto id = store.RegisterBuffer(
        "m", Role::kSource, srcs[b]->Lend(),
        {Whole("w" + std::to_string(b), DType::kUINT8, {static_cast<int64_t>(kSize)}, 0)}, "");
    REQUIRE(id.ok());
    ids.push_back(*id);
  }
  auto published = store.Publish("m", 1, ids);
  REQUIRE(published.ok());
  CHECK(published->bytes == kBuffers * kSize);
  auto snapshot = store.GetLocalSnapshot("m", 1);
  REQUIRE(snapshot.ok());
  REQUIRE((*snapshot)->pieces.size() == static_cast<size_t>(kBuffers));
  for (int b = 0; b < kBuffers; ++b) {
    INFO("buffer " << b);
    const auto& pieces = (*snapshot)->pieces;
    auto it = std::find_if(pieces.begin(), pieces.end(),
                           [&](const LocalSnapshot::Piece& p) { return p.buffer_id == ids[b]; });
    REQUIRE(it != pieces.end());
    const LocalSnapshot::Piece& piece = *it;
    REQUIRE(piece.xxh3 != nullptr);
    CHECK(*piece.xxh3 == HashChunks(srcs[b]->data, kSize));
    CHECK(std::memcmp(piece.slot->data(), srcs[b]->data, kSize) == 0);
  }
}

TEST_CASE_METHOD(Fixture, "Publish hashes the ranges peers asked checksums for", "[store]") {
  constexpr uint64_t kSize = 1 << 20;
  // Snapshots for other nodes are kept only when something serves them.
  store.AddListener(&snapshot_reader);
  TestBuffer src(kSize);
  auto s = store.RegisterBuffer("m", Role::kSource, src.Lend(),
                                {Whole("w", DType::kUINT8, {static_cast<int64_t>(kSize)}, 0)}, "");
  REQUIRE(s.ok());
  uint64_t version = 0;
  // Publishes a new version and returns its Publish-time range sums (null: none).
  auto publish = [&]() -> std::shared_ptr<const RangeSums> {
    ++version;
    for (uint64_t i = 0; i < kSize; ++i) src.data[i] = static_cast<uint8_t>(i * version + i / 7);
    REQUIRE(store.Publish("m", version, {*s}).ok());
    auto snapshot = store.GetLocalSnapshot("m", version);
    REQUIRE(snapshot.ok());
    REQUIRE((*snapshot)->pieces.size() == 1);
    return (*snapshot)->pieces[0].range_xxh3;
  };
  CHECK(publish() == nullptr);  // nobody asked yet
  // One run of 100 ranges, and one Publish can never hash (longer than a copy block).
  store.NoteChecksumRanges(*s, kSize, {{4096, 1024, 8192, 100}, {0, kCopyBlockBytes + 1, 0, 1}});
  auto sums = publish();
  REQUIRE(sums != nullptr);
  REQUIRE(sums->size() == 100);
  for (uint64_t i = 0; i < 100; ++i) {
    uint64_t got = 0;
    REQUIRE(sums->Find(4096 + i * 8192, 1024, &got));
    CHECK(got == XXH3_64bits(src.data + 4096 + i * 8192, 1024));
  }
  // Asking again about its first ranges (a refetch) keeps the run.
  store.NoteChecksumRanges(*s, kSize, {{4096, 1024, 8192, 3}});
  sums = publish();
  REQUIRE(sums != nullptr);
  CHECK(sums->size() == 100);
  // Another run at the same offset replaces it.
  store.NoteChecksumRanges(*s, kSize, {{4096, 2048, 8192, 10}});
  sums = publish();
  REQUIRE(sums != nullptr);
  CHECK(sums->size() == 10);
  uint64_t got = 0;
  CHECK(sums->Find(4096 + 9 * 8192, 2048, &got));
  CHECK_FALSE(sums->Find(4096, 1024, &got));
  // Not asked about again: dropped after a few Publishes.
  int publishes = 0;
  while (publish() != nullptr) REQUIRE(++publishes < 6);
  CHECK(publishes >= 3);
}

TEST_CASE_METHOD(Fixture, "a version is a snapshot taken at Publish", "[store]") {
  TestBuffer src(1024), dst(1024);
  std::memset(src.data, 1, 1024);
  auto s = store.RegisterBuffer("m", Role::kSource, src.Lend(),
                                {Whole("w", DType::kUINT8, {1024}, 0)}, "");
  auto d = store.RegisterBuffer("m", Role::kDestination, dst.Lend(),
                                {Whole("w", DType::kUINT8, {1024}, 0)}, "");
  REQUIRE(store.Publish("m", 1, {*s}).ok());
  std::memset(src.data, 2, 1024);  // the trainer moves on at once
  REQUIRE(store.Apply("m", 1, {*d}).ok());
  for (int i = 0; i < 1024; ++i) REQUIRE(dst.data[i] == 1);
}

TEST_CASE_METHOD(Fixture, "a version completes only when every source buffer published it",
                 "[store]") {
  const std::vector<int64_t> shape{4, 16};
  TestBuffer r0(32 * 4), r1(32 * 4), dst(64 * 4);
  for (int i = 0; i < 128; ++i) {
    r0.data[i] = static_cast<uint8_t>(i);
    r1.data[i] = static_cast<uint8_t>(200 - i);
  }
  auto a = store.RegisterBuffer("m", Role::kSource, r0.Lend(),
                                {Rows("w", DType::kFP32, shape, 0, 2, 0)}, "rank0");
  auto b = store.RegisterBuffer("m", Role::kSource, r1.Lend(),
                                {Rows("w", DType::kFP32, shape, 2, 2, 0)}, "rank1");
  auto d = store.RegisterBuffer("m", Role::kDestination, dst.Lend(),
                                {Whole("w", DType::kFP32, shape, 0)}, "engine");
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(d.ok());

  REQUIRE(store.Publish("m", 1, {*a}).ok());
  CHECK(store.LatestVersion("m") == 0);
  CHECK(store.Apply("m", 1, {*d}).status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(store.WaitForVersion("m", 1, In(30), nullptr).status().code() ==
        absl::StatusCode::kDeadlineExceeded);
  REQUIRE(store.Publish("m", 1, {*b}).ok());
  CHECK(store.LatestVersion("m") == 1);
  REQUIRE(store.Apply("m", 1, {*d}).ok());
  CHECK(std::memcmp(dst.data, r0.data, 128) == 0);
  CHECK(std::memcmp(dst.data + 128, r1.data, 128) == 0);
}

TEST_CASE_METHOD(Fixture,
                 "releasing a lagging source abandons the version it never published; the "
                 "next one completes",
                 "[store]") {
  TestBuffer r0(64), r1(64), r2(64);
  auto a = store.RegisterBuffer("m", Role::kSource, r0.Lend(), {Whole("x", DType::kUINT8, {64}, 0)},
                                "rank0");
  auto b = store.RegisterBuffer("m", Role::kSource, r1.Lend(), {Whole("y", DType::kUINT8, {64}, 0)},
                                "rank1");
  REQUIRE(store.Publish("m", 1, {*a}).ok());
  REQUIRE(store.Publish("m", 1, {*b}).ok());
  CHECK(store.LatestVersion("m") == 1);
  // Rank 1 goes before publishing 2: version 2 would lack tensor y.
  REQUIRE(store.Publish("m", 2, {*a}).ok());
  REQUIRE(store.ReleaseBuffer(*b, "its process exited").ok());
  CHECK(store.LatestVersion("m") == 1);
  auto models = store.Models();
  REQUIRE(models.size() == 1);
  CHECK(models[0].abandoned_version == 2);
  CHECK(models[0].abandoned_error.find(*b) != std::string::npos);
  CHECK(models[0].abandoned_error.find("its process exited") != std::string::npos);
  CHECK(metrics.Get(kVersionsAbandoned) == 1);
  CHECK(store.ReleaseBuffer(*b).code() == absl::StatusCode::kNotFound);
  // A version the released buffer did publish is kept: its successor completes 3 with rank 0.
  auto c = store.RegisterBuffer("m", Role::kSource, r2.Lend(), {Whole("y", DType::kUINT8, {64}, 0)},
                                "rank1-successor");
  REQUIRE(c.ok());
  REQUIRE(store.Publish("m", 3, {*c}).ok());
  REQUIRE(store.Publish("m", 3, {*a}).ok());
  CHECK(store.LatestVersion("m") == 3);
}

TEST_CASE_METHOD(Fixture, "a source released after publishing leaves its piece in the version",
                 "[store]") {
  TestBuffer r0(64), r1(64);
  auto a =
      store.RegisterBuffer("m", Role::kSource, r0.Lend(), {Whole("x", DType::kUINT8, {64}, 0)}, "");
  auto b =
      store.RegisterBuffer("m", Role::kSource, r1.Lend(), {Whole("y", DType::kUINT8, {64}, 0)}, "");
  REQUIRE(store.Publish("m", 1, {*b}).ok());
  REQUIRE(store.ReleaseBuffer(*b).ok());  // published 1, then went
  CHECK(store.LatestVersion("m") == 0);
  REQUIRE(store.Publish("m", 1, {*a}).ok());
  CHECK(store.LatestVersion("m") == 1);
  CHECK(store.Models()[0].abandoned_version == 0);
}

TEST_CASE_METHOD(Fixture, "retention drops old versions; codes tell dropped from not complete",
                 "[store]") {
  TestBuffer src(16), dst(16);
  auto s =
      store.RegisterBuffer("m", Role::kSource, src.Lend(), {Whole("w", DType::kINT32, {4}, 0)}, "");
  auto d = store.RegisterBuffer("m", Role::kDestination, dst.Lend(),
                                {Whole("w", DType::kINT32, {4}, 0)}, "");
  for (uint64_t v = 1; v <= 4; ++v) {
    std::memset(src.data, static_cast<int>(v), 16);
    REQUIRE(store.Publish("m", v, {*s}).ok());
  }
  auto models = store.Models();
  REQUIRE(models.size() == 1);
  CHECK(models[0].versions == std::vector<uint64_t>{3, 4});
  CHECK(models[0].latest_version == 4);
  CHECK(store.Apply("m", 2, {*d}).status().code() == absl::StatusCode::kNotFound);
  CHECK(store.Apply("m", 5, {*d}).status().code() == absl::StatusCode::kFailedPrecondition);
  // A version this node skipped (never complete here) is not "dropped".
  std::memset(src.data, 7, 16);
  REQUIRE(store.Publish("m", 7, {*s}).ok());
  CHECK(store.Apply("m", 6, {*d}).status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(store.Apply("m", 3, {*d}).status().code() == absl::StatusCode::kNotFound);
  auto applied = store.Apply("m", 4, {*d});
  REQUIRE(applied.ok());
  CHECK(dst.data[0] == 4);
  CHECK(metrics.Get(kVersionsDropped) == 3);
}

TEST_CASE_METHOD(Fixture, "publish rejects stale versions and foreign buffers", "[store]") {
  TestBuffer src(16), dst(16);
  auto s =
      store.RegisterBuffer("m", Role::kSource, src.Lend(), {Whole("w", DType::kINT32, {4}, 0)}, "");
  auto d = store.RegisterBuffer("m", Role::kDestination, dst.Lend(),
                                {Whole("w", DType::kINT32, {4}, 0)}, "");
  REQUIRE(store.Publish("m", 5, {*s}).ok());
  CHECK(store.Publish("m", 5, {*s}).status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(store.Publish("m", 4, {*s}).status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(store.Publish("m", 0, {*s}).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(store.Publish("m", 6, {"nope"}).status().code() == absl::StatusCode::kNotFound);
  CHECK(store.Publish("m", 6, {*d}).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(store.Publish("other", 6, {*s}).status().code() == absl::StatusCode::kNotFound);
  CHECK(store.Apply("m", 0, {*s}).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(store.LatestVersion("m") == 5);
}

TEST_CASE_METHOD(Fixture, "registration checks tensors against the model", "[store]") {
  TestBuffer a(64), b(64), c(64), d(64);
  REQUIRE(
      store.RegisterBuffer("m", Role::kSource, a.Lend(), {Whole("w", DType::kBF16, {32}, 0)}, "")
          .ok());
  // Same tensor, other dtype, on another source: rejected.
  CHECK(store.RegisterBuffer("m", Role::kSource, b.Lend(), {Whole("w", DType::kFP16, {32}, 0)}, "")
            .status()
            .code() == absl::StatusCode::kInvalidArgument);
  // Destination with another global shape: rejected.
  CHECK(store
            .RegisterBuffer("m", Role::kDestination, c.Lend(), {Whole("w", DType::kBF16, {16}, 0)},
                            "")
            .status()
            .code() == absl::StatusCode::kInvalidArgument);
  // Destination converting bf16 to fp16: accepted.
  CHECK(store
            .RegisterBuffer("m", Role::kDestination, d.Lend(), {Whole("w", DType::kFP16, {32}, 0)},
                            "")
            .ok());
  CHECK(store.Models()[0].source_buffers == 1);
  CHECK(store.Models()[0].destination_buffers == 1);
}

TEST_CASE_METHOD(Fixture, "slices of one request, and a source after its destinations, agree",
                 "[store]") {
  TestBuffer a(64), b(64), c(64), d(64), e(64);
  // One request, two row halves of one tensor with different dtypes: the model's first buffer.
  CHECK(store
            .RegisterBuffer("m", Role::kSource, a.Lend(),
                            {Rows("w", DType::kBF16, {2, 8}, 0, 1, 0),
                             Rows("w", DType::kFP16, {2, 8}, 1, 1, 16)},
                            "")
            .status()
            .code() == absl::StatusCode::kInvalidArgument);
  // ... or with different global shapes.
  CHECK(store
            .RegisterBuffer("m", Role::kDestination, b.Lend(),
                            {Rows("w", DType::kBF16, {2, 8}, 0, 1, 0),
                             Rows("w", DType::kBF16, {4, 4}, 1, 1, 16)},
                            "")
            .status()
            .code() == absl::StatusCode::kInvalidArgument);
  CHECK(store.Models().empty());  // nothing registered
  // A destination first, then a source it can't be converted from: the source wins, and the
  // destination is the one refused (shown in Models, naming the source).
  auto dest = store.RegisterBuffer("m", Role::kDestination, c.Lend(),
                                   {Whole("w", DType::kFP16, {16}, 0)}, "engine");
  REQUIRE(dest.ok());
  auto source = store.RegisterBuffer("m", Role::kSource, d.Lend(),
                                     {Whole("w", DType::kINT32, {16}, 0)}, "rank0");
  REQUIRE(source.ok());
  const std::vector<ModelInfo> models = store.Models();
  REQUIRE(models[0].buffers.size() == 2);
  for (const BufferInfo& b : models[0].buffers) {
    INFO(b.id << ": " << b.error);
    CHECK(b.error.empty() == (b.id == *source));
    if (b.id == *dest) CHECK(b.error.find(*source) != std::string::npos);
  }
  // A second source that disagrees with the first is refused, naming it and its client.
  const auto refused =
      store.RegisterBuffer("m", Role::kSource, e.Lend(), {Whole("w", DType::kBF16, {16}, 0)}, "");
  CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(refused.status().message()).find("client rank0") != std::string::npos);
  CHECK(store.Models()[0].source_buffers == 1);
  // Once that source is gone, the destination is usable again.
  REQUIRE(store.ReleaseBuffer(*source).ok());
  CHECK(store.Models()[0].buffers[0].error.empty());
}

TEST_CASE_METHOD(Fixture, "waiters see completions in order and wake at shutdown", "[store]") {
  TestBuffer src(8);
  auto s =
      store.RegisterBuffer("m", Role::kSource, src.Lend(), {Whole("w", DType::kUINT8, {8}, 0)}, "");
  std::thread publisher([&] {
    for (uint64_t v = 1; v <= 3; ++v) REQUIRE(store.Publish("m", v, {*s}).ok());
  });
  auto seen = store.WaitForVersion("m", 3, In(5000), nullptr);
  publisher.join();
  REQUIRE(seen.ok());
  CHECK(*seen == 3);
  auto events = store.WaitForCompletions("m", 1, In(100), nullptr);
  REQUIRE(events.ok());
  CHECK(*events == std::vector<uint64_t>{2, 3});
  CHECK(store.WaitForCompletions("m", 3, In(20), nullptr).status().code() ==
        absl::StatusCode::kDeadlineExceeded);
  CHECK(store.WaitForVersion("m", 9, In(5000), [] { return true; }).status().code() ==
        absl::StatusCode::kCancelled);

  std::thread stopper([&] {
    std::this_thread::sleep_for(milliseconds(50));
    store.Shutdown();
  });
  CHECK(store.WaitForVersion("m", 9, In(10000), nullptr).status().code() ==
        absl::StatusCode::kUnavailable);
  stopper.join();
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

// A receiving node: the pull jobs the store asks for, with the deltas it offers in them.
struct Receiver {
  Metrics metrics;
  std::vector<PullJob> jobs;
  testing::PullRecorder recorder{&jobs};
  Store store{TestOptions("engine"), &metrics};
  std::shared_ptr<std::mutex> mu = std::make_shared<std::mutex>();

  Receiver() {
    store.AddListener(&recorder);
    TestBuffer dest(2048);
    REQUIRE(store
                .RegisterBuffer("m", Role::kDestination, dest.Lend(),
                                {Whole("w", DType::kBF16, {1024}, 0)}, "engine")
                .ok());
    // As another node announces it: normalized.
    TensorSlice w = Rows("w", DType::kBF16, {1024}, 0, 1024, 0);
    w.buffer_strides = {1};
    SourceLayout layout{
        "trainer-1", std::make_shared<std::vector<TensorSlice>>(std::vector<TensorSlice>{w}), 2048};
    store.SetRemoteSources("trainer", "m", {layout});
  }

  // Completes the last job as if every byte arrived.
  void Finish() {
    auto slot = store.AcquireSlot(2048);
    REQUIRE(slot.ok());
    store.FinishPull(jobs.back(), absl::OkStatus(), {*slot});
  }
};

RemoteDeltaRef DeltaRef(uint64_t base, uint64_t version) {
  return {"trainer-1", base, version, "delta-key", 100};
}

TEST_CASE("a pull offers the chain of deltas from the newest version held", "[store][delta]") {
  Receiver r;
  r.store.AnnounceRemoteVersion("trainer", "m", 1, {{"trainer-1", "key", 2048}}, {DeltaRef(0, 1)});
  REQUIRE(r.jobs.size() == 1);
  CHECK(r.jobs[0].fetches.at(0).base == nullptr);  // nothing held yet: in full
  r.Finish();
  REQUIRE(r.store.LatestVersion("m") == 1);

  // Two versions ahead, with both steps offered: a chain 1 -> 2 -> 3.
  r.store.AnnounceRemoteVersion("trainer", "m", 3, {{"trainer-1", "key", 2048}},
                                {DeltaRef(2, 3), DeltaRef(1, 2)});
  REQUIRE(r.jobs.size() == 2);
  const PullJob::Fetch& fetch = r.jobs[1].fetches.at(0);
  REQUIRE(fetch.base != nullptr);
  CHECK(fetch.base_version == 1);
  REQUIRE(fetch.deltas.size() == 2);
  CHECK(fetch.deltas[0].base_version == 1);
  CHECK(fetch.deltas[0].version == 2);
  CHECK(fetch.deltas[1].base_version == 2);
  CHECK(fetch.deltas[1].version == 3);
  r.Finish();
  REQUIRE(r.store.LatestVersion("m") == 3);

  // A gap in the chain (4 -> 5 missing): in full.
  r.store.AnnounceRemoteVersion("trainer", "m", 6, {{"trainer-1", "key", 2048}}, {DeltaRef(5, 6)});
  REQUIRE(r.jobs.size() == 3);
  CHECK(r.jobs[2].fetches.at(0).base == nullptr);
  CHECK(r.jobs[2].fetches.at(0).deltas.empty());
}

}  // namespace
}  // namespace refit
