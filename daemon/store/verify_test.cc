// The Verifier on its own (verify.h): a destination compared with what a plan writes there,
// the stale tensors named, the released-copy answers, Finish's DATA_LOSS.

#include "daemon/store/verify.h"

#include <cstdint>
#include <string>
#include <vector>

#include "catch2/catch.hpp"

namespace refit {
namespace {

// A uint8 tensor of `n` elements at `offset` of its buffer.
TensorSlice Bytes(std::string name, uint64_t offset, int64_t n) {
  TensorSlice s;
  s.name = std::move(name);
  s.dtype = DType::kUINT8;
  s.global_shape = {n};
  s.offsets = {0};
  s.sizes = {n};
  s.buffer_offset = offset;
  s.buffer_strides = {1};
  return s;
}

plan::CopyOp Copy(uint64_t src_offset, uint64_t dst_offset, uint64_t count) {
  plan::CopyOp op;
  op.src_offset = src_offset;
  op.dst_offset = dst_offset;
  op.count = count;
  op.src_dtype = DType::kUINT8;
  op.dst_dtype = DType::kUINT8;
  return op;
}

TEST_CASE("Verifier: equal bytes check clean; a changed byte names its tensor and fails Finish") {
  const std::vector<TensorSlice> slices = {Bytes("a", 0, 8), Bytes("b", 8, 8)};
  plan::Plan plan;
  plan.ops = {Copy(0, 0, 8), Copy(8, 8, 8)};
  std::vector<uint8_t> source(16), dest(16);
  for (int i = 0; i < 16; ++i) source[i] = dest[i] = static_cast<uint8_t>(i + 1);

  Verifier clean("m");
  VerifyResult result;
  result.buffer_id = "buf";
  result.version = 3;
  clean.Compare(plan, {source.data()}, {"buf", &slices}, dest.data(), &result);
  CHECK(result.checked);
  CHECK(result.stale_tensors.empty());
  auto ok = clean.Finish({result});
  REQUIRE(ok.ok());
  CHECK(ok->size() == 1);

  dest[9] ^= 0xff;  // in tensor "b"
  Verifier dirty("m");
  VerifyResult stale;
  stale.buffer_id = "buf";
  stale.version = 3;
  dirty.Compare(plan, {source.data()}, {"buf", &slices}, dest.data(), &stale);
  CHECK(stale.checked);
  CHECK(stale.stale_tensors == std::vector<std::string>{"b"});
  auto lost = dirty.Finish({stale});
  REQUIRE(lost.status().code() == absl::StatusCode::kDataLoss);
  CHECK(std::string(lost.status().message()) ==
        "model m: destination bytes differ from the version they hold: buffer buf (version 3): "
        "b (written by someone else since that Apply?)");
}

TEST_CASE("TensorsOfOps names each tensor once, by buffer, and bytes outside every slice") {
  const std::vector<TensorSlice> first = {Bytes("a", 0, 8)};
  const std::vector<TensorSlice> second = {Bytes("c", 4, 4)};
  plan::Plan plan;
  plan.ops = {Copy(0, 0, 4), Copy(4, 4, 4), Copy(8, 0, 4), Copy(12, 4, 4)};
  plan.ops[2].dst_location = 1;
  plan.ops[3].dst_location = 1;
  const auto tensors = TensorsOfOps(plan, {0, 1, 2, 3}, {{"x", &first}, {"y", &second}});
  REQUIRE(tensors.size() == 2);
  CHECK(tensors.at("x") == std::vector<std::string>{"a"});
  CHECK(tensors.at("y") == std::vector<std::string>{"bytes at offset 0", "c"});
}

TEST_CASE("Verifier::Released: checked, differs, or nothing to compare with") {
  const absl::Status held = absl::FailedPreconditionError("the held copy was released");
  Verifier verifier("m");
  VerifyResult same, differs, nothing;
  verifier.Released(held, absl::OkStatus(), &same);
  CHECK(same.checked);
  CHECK(same.note.empty());
  verifier.Released(held, absl::DataLossError("buffer d: w differs"), &differs);
  CHECK(differs.checked);
  CHECK(differs.stale_tensors == std::vector<std::string>{"buffer d: w differs"});
  verifier.Released(held, absl::FailedPreconditionError("no digests"), &nothing);
  CHECK_FALSE(nothing.checked);
  CHECK(nothing.note == "the held copy was released");
  auto finish = verifier.Finish({same, differs, nothing});
  REQUIRE(finish.status().code() == absl::StatusCode::kDataLoss);
  CHECK(std::string(finish.status().message()).find("buffer d: w differs") != std::string::npos);
}

}  // namespace
}  // namespace refit
