// ExecuteOnHost on large ops, where it streams stores and copies row groups together: bytes
// equal a reference gather computed here.

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "catch2/catch.hpp"
#include "daemon/plan/plan.h"

namespace refit::plan {
namespace {

TensorSlice Part(const std::string& name, std::vector<int64_t> shape, std::vector<int64_t> off,
                 std::vector<int64_t> size, uint64_t at) {
  TensorSlice s;
  s.name = name;
  s.dtype = DType::kBF16;
  s.global_shape = std::move(shape);
  s.offsets = std::move(off);
  s.sizes = std::move(size);
  s.buffer_offset = at;
  return s;
}

TEST_CASE("large row-split and contiguous ops copy exactly", "[plan][execute]") {
  // Tensor a [R, 2048] split on columns over 4 sources (rows of 1 KiB), gathered into 2
  // destinations; tensor b [2048, 1024] split on rows, 4 -> 2 (1 MiB contiguous pieces); tensor
  // c, one long run from source 0 to destination 1. The large case (> 32 MiB) runs on several
  // threads, with row groups and long runs cut into tasks.
  const int64_t R = GENERATE(1024, 8192), C = 2048;
  const int64_t K = R == 1024 ? 4096 : (int64_t{12} << 20);  // elements of c
  std::vector<std::vector<TensorSlice>> src(4), dst(2);
  std::vector<uint64_t> src_size(4), dst_size(2);
  for (int r = 0; r < 4; ++r) {
    src[r].push_back(Part("a", {R, C}, {0, r * C / 4}, {R, C / 4}, 0));
    src[r].push_back(Part("b", {2048, 1024}, {r * 512, 0}, {512, 1024}, R * C / 4 * 2));
    src_size[r] = R * C / 4 * 2 + 512 * 1024 * 2;
  }
  src[0].push_back(Part("c", {K}, {0}, {K}, src_size[0]));
  src_size[0] += K * 2;
  for (int d = 0; d < 2; ++d) {
    dst[d].push_back(Part("a", {R, C}, {0, d * C / 2}, {R, C / 2}, 0));
    dst[d].push_back(Part("b", {2048, 1024}, {d * 1024, 0}, {1024, 1024}, R * C / 2 * 2));
    dst_size[d] = R * C / 2 * 2 + 1024 * 1024 * 2;
  }
  dst[1].push_back(Part("c", {K}, {0}, {K}, dst_size[1]));
  dst_size[1] += K * 2;
  for (int r = 0; r < 4; ++r) REQUIRE(NormalizeAndValidateBuffer(src[r], src_size[r]).ok());
  for (int d = 0; d < 2; ++d) REQUIRE(NormalizeAndValidateBuffer(dst[d], dst_size[d]).ok());
  std::vector<PlacedSlice> sources, destinations;
  for (uint32_t r = 0; r < 4; ++r) {
    for (const auto& s : src[r]) sources.push_back({&s, r, 0});
  }
  for (uint32_t d = 0; d < 2; ++d) {
    for (const auto& s : dst[d]) destinations.push_back({&s, d, 0});
  }
  PlanOptions options;
  options.multi_row_ops = true;
  auto plan = BuildPlan(sources, destinations, options);
  REQUIRE(plan.ok());

  std::mt19937 rng(3);
  std::vector<std::vector<uint16_t>> in(4);
  for (int r = 0; r < 4; ++r) {
    in[r].resize(src_size[r] / 2);
    for (auto& x : in[r]) x = static_cast<uint16_t>(rng());
  }
  std::vector<std::vector<uint16_t>> out(2);
  for (int d = 0; d < 2; ++d) out[d].assign(dst_size[d] / 2, 0xFFFF);
  std::vector<const uint8_t*> s;
  std::vector<uint8_t*> t;
  for (auto& v : in) s.push_back(reinterpret_cast<const uint8_t*>(v.data()));
  for (auto& v : out) t.push_back(reinterpret_cast<uint8_t*>(v.data()));
  ExecuteOnHost(*plan, s, t);

  size_t wrong = 0;
  for (int d = 0; d < 2; ++d) {
    for (int64_t i = 0; i < R; ++i) {
      for (int64_t j = 0; j < C / 2; ++j) {
        const int64_t gc = d * C / 2 + j;
        const int r = static_cast<int>(gc / (C / 4));
        wrong += out[d][i * (C / 2) + j] != in[r][i * (C / 4) + gc % (C / 4)];
      }
    }
    for (int64_t i = 0; i < 1024; ++i) {
      const int64_t gr = d * 1024 + i;
      const int r = static_cast<int>(gr / 512);
      for (int64_t j = 0; j < 1024; ++j) {
        wrong += out[d][R * C / 2 + i * 1024 + j] != in[r][R * C / 4 + (gr % 512) * 1024 + j];
      }
    }
  }
  const int64_t c_src = (R * C / 4 * 2 + 512 * 1024 * 2) / 2,
                c_dst = (R * C / 2 * 2 + 1024 * 1024 * 2) / 2;
  for (int64_t i = 0; i < K; ++i) wrong += out[1][c_dst + i] != in[0][c_src + i];
  CHECK(wrong == 0);

  // Verified install: what landed is what the plan says, by both paths.
  CHECK(VerifyOnHost(*plan, s, t).empty());
  std::vector<std::vector<uint16_t>> again(2);
  std::vector<uint8_t*> t2;
  for (int d = 0; d < 2; ++d) again[d].assign(dst_size[d] / 2, 0xFFFF);
  for (auto& v : again) t2.push_back(reinterpret_cast<uint8_t*>(v.data()));
  CHECK(ExecuteAndVerifyOnHost(*plan, s, t2).empty());
  CHECK(again == out);
  // The undo save folded in: destinations holding other bytes end up as `out`, and what was
  // saved puts every byte back (row groups, long runs cut into tasks, several threads).
  CHECK(SavedBytes(*plan) == plan->dst_bytes);
  std::vector<std::vector<uint16_t>> old(2);
  for (int d = 0; d < 2; ++d) {
    old[d].resize(dst_size[d] / 2);
    for (auto& x : old[d]) x = static_cast<uint16_t>(rng());
  }
  std::vector<std::vector<uint16_t>> fused = old;
  std::vector<uint8_t*> t3;
  for (auto& v : fused) t3.push_back(reinterpret_cast<uint8_t*>(v.data()));
  std::vector<uint8_t> saved(SavedBytes(*plan), 0);
  std::vector<uint8_t> marks(SaveTasks(*plan), 0);
  REQUIRE(marks.size() > 2);
  CHECK(ExecuteSaveAndVerifyOnHost(*plan, s, t3, saved.data(), marks.data()).empty());
  CHECK(fused == out);
  CHECK(std::count(marks.begin(), marks.end(), 1) == static_cast<long>(marks.size()));
  CHECK(RestorePlan(*plan, marks.data()).dst_bytes == SavedBytes(*plan));
  // As after a kill: the marked pieces alone go back (every other one here), the rest stay as
  // written; restoring the others then completes it.
  std::vector<uint8_t> even(marks.size(), 0), odd(marks.size(), 0);
  for (size_t k = 0; k < marks.size(); ++k) (k % 2 == 0 ? even : odd)[k] = 1;
  ExecuteOnHost(RestorePlan(*plan, even.data()), {saved.data()}, t3);
  CHECK(fused != old);
  CHECK(fused != out);
  ExecuteOnHost(RestorePlan(*plan, odd.data()), {saved.data()}, t3);
  CHECK(fused == old);
  // One byte of c changed afterwards: the op that writes it, and only that one, is reported.
  out[1][c_dst + K / 2] ^= 1;
  const std::vector<size_t> bad = VerifyOnHost(*plan, s, t);
  REQUIRE(bad.size() == 1);
  const CopyOp& op = plan->ops[bad[0]];
  CHECK(op.dst_location == 1);
  CHECK(op.dst_offset <= static_cast<uint64_t>(c_dst + K / 2) * 2);
  CHECK(op.dst_offset + op.count * 2 > static_cast<uint64_t>(c_dst + K / 2) * 2);
}

TEST_CASE("verification follows conversions and strides", "[plan][execute]") {
  // bf16 [64, 64] into an fp32 destination holding its transpose-free column half twice over
  // (strided by 2 columns): converted ops are checked element by element.
  TensorSlice src = Part("w", {64, 64}, {0, 0}, {64, 64}, 0);
  TensorSlice dst = Part("w", {64, 64}, {0, 0}, {64, 64}, 0);
  dst.dtype = DType::kFP32;
  dst.buffer_strides = {128, 2};  // every other fp32 slot
  std::vector<TensorSlice> sv{src}, dv{dst};
  REQUIRE(NormalizeAndValidateBuffer(sv, 64 * 64 * 2).ok());
  REQUIRE(NormalizeAndValidateBuffer(dv, 64 * 128 * 4).ok());
  auto plan = BuildPlan({{&sv[0], 0, 0}}, {{&dv[0], 0, 0}});
  REQUIRE(plan.ok());
  std::vector<uint16_t> in(64 * 64);
  std::mt19937 rng(5);
  for (auto& x : in) x = static_cast<uint16_t>(0x3f00 | (rng() & 0xff));  // finite values
  std::vector<float> out(64 * 128, -1.0f);
  std::vector<const uint8_t*> s{reinterpret_cast<const uint8_t*>(in.data())};
  std::vector<uint8_t*> t{reinterpret_cast<uint8_t*>(out.data())};
  CHECK(ExecuteAndVerifyOnHost(*plan, s, t).empty());
  // With the undo save folded in: the same bytes land, and the strided elements it overwrote
  // (only those) go back.
  std::vector<float> old(64 * 128);
  for (size_t i = 0; i < old.size(); ++i) old[i] = static_cast<float>(i);
  std::vector<float> fused = old;
  std::vector<uint8_t*> t2{reinterpret_cast<uint8_t*>(fused.data())};
  std::vector<uint8_t> saved(SavedBytes(*plan));
  CHECK(saved.size() == 64 * 64 * 4);
  CHECK(ExecuteSaveAndVerifyOnHost(*plan, s, t2, saved.data()).empty());
  size_t wrong = 0;
  for (size_t i = 0; i < fused.size(); ++i) wrong += fused[i] != (i % 2 == 0 ? out[i] : old[i]);
  CHECK(wrong == 0);
  ExecuteOnHost(RestorePlan(*plan), {saved.data()}, t2);
  CHECK(fused == old);
  out[2 * 7] += 1.0f;  // element (0, 7)
  CHECK_FALSE(VerifyOnHost(*plan, s, t).empty());
  out[2 * 7 + 1] = 99.0f;  // a gap the plan never writes: not its business
  out[2 * 7] -= 1.0f;
  CHECK(VerifyOnHost(*plan, s, t).empty());
}

TEST_CASE("the verified copy compares the destination memory, not what it meant to write",
          "[plan][execute]") {
  // The destination's two pages are one page of memory mapped twice: one row's bytes land over
  // the other's within the copy (as a concurrent writer's would) before it is compared, so the
  // memory does not hold what the op wrote. Verified execution reports the op; a check of the
  // copy's own registers would not.
  const long page = sysconf(_SC_PAGESIZE);
  REQUIRE(page > 0);
  const int64_t cols = page / 2;  // bf16: one row per page
  const int fd = memfd_create("refit-execute-test", 0);
  REQUIRE(fd >= 0);
  REQUIRE(ftruncate(fd, page) == 0);
  void* area = mmap(nullptr, 2 * page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(area != MAP_FAILED);
  uint8_t* base = static_cast<uint8_t*>(area);
  for (int i = 0; i < 2; ++i) {
    REQUIRE(mmap(base + i * page, page, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) !=
            MAP_FAILED);
  }
  close(fd);
  // One op copies both rows (one source buffer): row 1 lands over row 0 within it.
  std::vector<TensorSlice> sv{Part("w", {2, cols}, {0, 0}, {2, cols}, 0)};
  std::vector<TensorSlice> d{Part("w", {2, cols}, {0, 0}, {2, cols}, 0)};
  REQUIRE(NormalizeAndValidateBuffer(sv, 2 * page).ok());
  REQUIRE(NormalizeAndValidateBuffer(d, 2 * page).ok());
  auto plan = BuildPlan({{&sv[0], 0, 0}}, {{&d[0], 0, 0}});
  REQUIRE(plan.ok());
  REQUIRE(plan->ops.size() == 1);
  std::vector<uint8_t> rows(2 * page, 0x11);
  std::memset(rows.data() + page, 0x22, page);
  std::vector<const uint8_t*> src{rows.data()};
  std::vector<uint8_t*> dst{base};
  CHECK(ExecuteAndVerifyOnHost(*plan, src, dst) == std::vector<size_t>{0});
  CHECK(std::memcmp(base, base + page, page) == 0);  // one page of memory: not both rows
  CHECK(VerifyOnHost(*plan, src, dst) == std::vector<size_t>{0});
  // The same with the undo save folded in: the save reads the destination too, and the check
  // still reads what landed in memory.
  std::vector<uint8_t> saved(SavedBytes(*plan));
  CHECK(ExecuteSaveAndVerifyOnHost(*plan, src, dst, saved.data()) == std::vector<size_t>{0});
  CHECK(std::memcmp(base, base + page, page) == 0);
  // Mapped apart, the same plan lands and checks clean.
  std::vector<uint8_t> apart(2 * page, 0);
  dst[0] = apart.data();
  CHECK(ExecuteAndVerifyOnHost(*plan, src, dst).empty());
  CHECK(apart == rows);
  munmap(area, 2 * page);
}

}  // namespace
}  // namespace refit::plan
