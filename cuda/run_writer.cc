// The host RunWriter (run_writer.h): the CPU twins of the GPU run kernels on host memory.

#include "cuda/run_writer.h"

#include "absl/strings/str_cat.h"
#include "cuda/kernels.h"

namespace refit::cuda {
namespace {

class HostRunWriter final : public RunWriter {
 public:
  explicit HostRunWriter(const Region& dst) : dst_(dst) {}

  absl::Status Upload(const std::vector<ByteRun>& runs,
                      const std::vector<uint8_t>& values) override {
    if (absl::Status ok = CheckRuns(runs, dst_.size(), values.size()); !ok.ok()) return ok;
    runs_ = &runs;
    values_ = &values;
    return absl::OkStatus();
  }
  absl::Status SaveOld(uint8_t* old) override {
    if (!runs_) return NotUploaded();
    cpu::GatherRuns(old, runs_->data(), runs_->size(), dst_.data());
    return absl::OkStatus();
  }
  absl::Status Scatter() override {
    if (!runs_) return NotUploaded();
    cpu::ScatterRuns(dst_.data(), runs_->data(), runs_->size(), values_->data());
    return absl::OkStatus();
  }
  absl::Status ReadBack(uint8_t* landed) override { return SaveOld(landed); }
  absl::Status Restore(const uint8_t* old) override {
    if (!runs_) return NotUploaded();
    cpu::ScatterRuns(dst_.data(), runs_->data(), runs_->size(), old);
    return absl::OkStatus();
  }

 private:
  static absl::Status NotUploaded() {
    return absl::FailedPreconditionError("RunWriter: nothing uploaded");
  }
  const Region& dst_;
  // The caller's lists (Upload's contract: they outlive the writer's use of them).
  const std::vector<ByteRun>* runs_ = nullptr;
  const std::vector<uint8_t>* values_ = nullptr;
};

}  // namespace

absl::Status CheckRuns(const std::vector<ByteRun>& runs, uint64_t region_bytes,
                       uint64_t values_bytes) {
  for (const ByteRun& run : runs) {
    if (run.dst_offset > region_bytes || run.bytes > region_bytes - run.dst_offset ||
        run.value_offset > values_bytes || run.bytes > values_bytes - run.value_offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          "byte run [", run.dst_offset, ", +", run.bytes, ") from values at ", run.value_offset,
          " is outside the region (", region_bytes, " bytes) or the values (", values_bytes, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<RunWriter>> OpenHostRunWriter(const Region& dst) {
  if (dst.kind() != MemoryKind::kHost) {
    return absl::FailedPreconditionError(
        absl::StrCat("a host RunWriter for ", dst.Describe(), ", which is not host memory"));
  }
  return std::unique_ptr<RunWriter>(new HostRunWriter(dst));
}

}  // namespace refit::cuda
