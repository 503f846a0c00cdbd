// Registration is idempotent for the same caller and memory (issue 18): the same owner
// registering the same shm range the same way gets its buffer back; anything else on that
// memory is ALREADY_EXISTS and changes nothing; a release of a gone id is NOT_FOUND.

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "catch2/catch.hpp"
#include "daemon/memory/region.h"
#include "daemon/store/store.h"

namespace refit {
namespace {

TensorSlice Whole(const std::string& name, DType dtype, std::vector<int64_t> shape) {
  TensorSlice s;
  s.name = name;
  s.dtype = dtype;
  s.global_shape = std::move(shape);
  return s;
}

// The first half of FP32 tensor `name` of 1024 elements: a layout the model agrees with.
TensorSlice Half(const std::string& name) {
  TensorSlice s = Whole(name, DType::kFP32, {1024});
  s.offsets = {0};
  s.sizes = {512};
  return s;
}

// A POSIX shm object of `size` bytes for the test's life.
struct Shm {
  explicit Shm(uint64_t size) : name(absl::StrCat("/r18c-register-", getpid(), "-", ++count)) {
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    REQUIRE(fd >= 0);
    REQUIRE(ftruncate(fd, static_cast<off_t>(size)) == 0);
    close(fd);
  }
  ~Shm() { shm_unlink(name.c_str()); }
  std::unique_ptr<Region> Map(uint64_t offset = 0, uint64_t size = 0) const {
    auto region = MapHostShm(name, offset, size);
    REQUIRE(region.ok());
    return std::move(region).value();
  }
  std::string name;
  static inline int count = 0;
};

struct Fixture {
  Fixture() {
    StoreOptions options;
    options.retain = 2;
    options.node = "test";
    store = std::make_unique<Store>(options, &metrics);
  }
  size_t Buffers(const std::string& model) {
    for (const ModelInfo& m : store->Models()) {
      if (m.name == model) return m.source_buffers + m.destination_buffers;
    }
    return 0;
  }
  Metrics metrics;
  std::unique_ptr<Store> store;
};

TEST_CASE_METHOD(Fixture, "the same owner registering the same memory gets the same buffer",
                 "[store][register]") {
  Shm shm(4096);
  auto first = store->RegisterBuffer("m", Role::kSource, shm.Map(),
                                     {Whole("w", DType::kFP32, {1024})}, "t", "uid 1 pid 2");
  REQUIRE(first.ok());
  auto again = store->RegisterBuffer("m", Role::kSource, shm.Map(),
                                     {Whole("w", DType::kFP32, {1024})}, "t", "uid 1 pid 2");
  REQUIRE(again.ok());
  CHECK(*again == *first);
  CHECK(Buffers("m") == 1);
  // Another range of the same object is other memory.
  auto half = store->RegisterBuffer("m", Role::kSource, shm.Map(0, 2048),
                                    {Whole("h", DType::kFP32, {512})}, "t", "uid 1 pid 2");
  REQUIRE(half.ok());
  CHECK(*half != *first);
  // Once released, the memory may be registered anew (a new id).
  REQUIRE(store->ReleaseBuffer(*first).ok());
  auto fresh = store->RegisterBuffer("m", Role::kSource, shm.Map(),
                                     {Whole("w", DType::kFP32, {1024})}, "t", "uid 1 pid 2");
  REQUIRE(fresh.ok());
  CHECK(*fresh != *first);
}

TEST_CASE_METHOD(Fixture, "a conflicting registration of the same memory changes nothing",
                 "[store][register]") {
  Shm shm(4096);
  auto first = store->RegisterBuffer("m", Role::kSource, shm.Map(),
                                     {Whole("w", DType::kFP32, {1024})}, "trainer", "uid 1 pid 2");
  REQUIRE(first.ok());
  REQUIRE(store->Publish("m", 1, {*first}).ok());
  struct Case {
    const char* what;
    std::string model;
    Role role;
    TensorSlice slice;
    std::string owner;
  } cases[] = {
      {"another owner", "m", Role::kSource, Whole("w", DType::kFP32, {1024}), "uid 1 pid 3"},
      {"another role", "m", Role::kDestination, Whole("w", DType::kFP32, {1024}), "uid 1 pid 2"},
      {"another layout", "m", Role::kSource, Half("w"), "uid 1 pid 2"},
      {"another model", "n", Role::kSource, Whole("w", DType::kFP32, {1024}), "uid 1 pid 2"},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    auto refused = store->RegisterBuffer(c.model, c.role, shm.Map(), {c.slice}, "x", c.owner);
    REQUIRE(refused.status().code() == absl::StatusCode::kAlreadyExists);
    CHECK(refused.status().message().find(*first) != std::string::npos);  // names the buffer
    CHECK(Buffers("m") == 1);
    CHECK(Buffers("n") == 0);
  }
  // A layout the model disagrees with is refused as before, whatever the memory.
  auto bad = store->RegisterBuffer("m", Role::kSource, shm.Map(),
                                   {Whole("w", DType::kBF16, {2048})}, "x", "uid 1 pid 2");
  CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);
  // The buffer still works.
  REQUIRE(store->Publish("m", 2, {*first}).ok());
}

TEST_CASE_METHOD(Fixture, "a release of an id that is gone is NOT_FOUND and disturbs nothing",
                 "[store][register]") {
  Shm shm(4096);
  auto id = store->RegisterBuffer("m", Role::kSource, shm.Map(), {Whole("w", DType::kFP32, {1024})},
                                  "t", "uid 1 pid 2");
  REQUIRE(id.ok());
  Shm other(4096);
  auto kept = store->RegisterBuffer("m", Role::kSource, other.Map(),
                                    {Whole("w", DType::kFP32, {1024})}, "t", "uid 1 pid 2");
  REQUIRE(kept.ok());
  REQUIRE(store->ReleaseBuffer(*id).ok());
  CHECK(store->ReleaseBuffer(*id).code() == absl::StatusCode::kNotFound);
  CHECK(store->ReleaseBuffer("test/m/src-99-0000000000000000").code() ==
        absl::StatusCode::kNotFound);
  CHECK(Buffers("m") == 1);
  REQUIRE(store->Publish("m", 1, {*kept}).ok());
}

}  // namespace
}  // namespace refit
