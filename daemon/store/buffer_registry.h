#pragma once

// Lending memory to the store and taking it back (issue 38: the store's client API split by
// job): what RegisterBuffer / ReleaseBuffer, the owner-exit watcher and the lease keeper
// (daemon/server) need of the store. Store implements it.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/memory/region.h"
#include "daemon/store/store_types.h"

namespace refit {

class BufferRegistry {
 public:
  virtual ~BufferRegistry() = default;
  // --max-slot-memory (0: none): RegisterBuffer's caller checks a SOURCE against it before it
  // maps the client's memory.
  virtual uint64_t max_slot_bytes() const = 0;
  // Lends the store `region` holding `slices` of `model`'s tensors; returns the buffer's id
  // (Store::RegisterBuffer documents the checks and the idempotence per memory and owner).
  virtual absl::StatusOr<std::string> RegisterBuffer(const std::string& model, Role role,
                                                     std::unique_ptr<Region> region,
                                                     std::vector<TensorSlice> slices,
                                                     const std::string& client,
                                                     const std::string& owner = "") = 0;
  // Stops using a buffer; `why` says why it goes, for logs and an abandoned version's message.
  virtual absl::Status ReleaseBuffer(const std::string& buffer_id, const std::string& why = "") = 0;
};

}  // namespace refit
