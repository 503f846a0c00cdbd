#pragma once

// Private to daemon/store: a model's tensors by name, kept up to date as its buffers register,
// so that RegisterBuffer looks each of its slices up once instead of building maps of the
// whole model (100,000 tensors: 100,000 hash inserts and allocations per registration).
//
//   NameTable       names -> 32-bit values: open addressing over 8-byte slots (a tag of the
//                   name's XXH3 and an entry), the names kept as views into slices that
//                   outlive the table; no allocation per name.
//   SourceIndex     a model's SOURCE slices by tensor, here and on other nodes (the first slice
//                   of each tensor, one of this node's before other nodes').
//   DestinationIndex a model's DESTINATION slices by tensor, and its scaled fp8 slices by
//                   scale tensor.
//
// Not thread-safe: the store's lock guards them (Store::Model).

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/common/types.h"

namespace refit {

class NameTable {
 public:
  static constexpr uint32_t kNone = ~uint32_t{0};

  NameTable() = default;
  NameTable(const NameTable&) = delete;
  NameTable& operator=(const NameTable&) = delete;
  ~NameTable() { Clear(); }

  // The hash the table files `name` under: callers that look a name up in several tables, or
  // prefetch, compute it once.
  static uint64_t Hash(std::string_view name);

  // Room for `names` names without growing.
  void Reserve(size_t names);
  // The value of `name`, or kNone.
  uint32_t Find(std::string_view name) const { return Find(name, Hash(name)); }
  uint32_t Find(std::string_view name, uint64_t hash) const;
  // Adds `name` -> `value` (not kNone) unless `name` is there; returns the value `name` has
  // now (the earlier one when it was there).
  uint32_t Insert(std::string_view name, uint32_t value) { return Insert(name, Hash(name), value); }
  uint32_t Insert(std::string_view name, uint64_t hash, uint32_t value);
  // Asks the CPU for the slot a name of `hash` starts its probe at (a loop over many names
  // prefetches a few names ahead: the table is bigger than the caches).
  void Prefetch(uint64_t hash) const {
    if (mask_ != 0) __builtin_prefetch(&slots_[hash & mask_]);
  }
  // The same for the name bytes of the entry in that slot (once the slot is cached), which a
  // Find that hits compares.
  void PrefetchName(uint64_t hash) const {
    if (mask_ == 0) return;
    const Slot& slot = slots_[hash & mask_];
    if (slot.name) __builtin_prefetch(slot.name);
  }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  void Clear();

 private:
  // 16 bytes (a third less memory to miss in than 24), all zero when empty (a fresh table is
  // calloc's memory, for a big one the kernel's zeroed pages: no pass to fill it).
  struct Slot {
    const char* name;  // null: empty; for a name of kLong bytes or more: a std::string_view*
    uint16_t size;     // the name's bytes, kLong for a long name
    uint16_t tag;      // bits 48-63 of the name's hash
    uint32_t value;
  };
  static constexpr uint16_t kLong = 0xffff;
  // The slot holding `name`, or the empty slot where it would go.
  size_t Probe(std::string_view name, uint64_t hash) const;
  void Rehash(size_t slots);

  Slot* slots_ = nullptr;  // mask_ + 1 of them (a power of two, at most 3/4 full)
  size_t mask_ = 0;        // 0: no slots
  size_t size_ = 0;
  std::deque<std::string_view> long_names_;  // Slot::name of the names of kLong bytes or more
};

// Several values per name: a table of each name's first value and a link per value.
class NameChains {
 public:
  void Reserve(size_t values);
  // Adds `value` to `name`'s values (after those added before).
  void Add(std::string_view name, const TensorSlice* value);
  // Calls fn(const TensorSlice&) for each value of `name`, in the order added; stops at the
  // first that returns false. Returns how many were visited.
  template <typename Fn>
  size_t ForEach(std::string_view name, Fn&& fn) const {
    size_t n = 0;
    for (uint32_t at = heads_.Find(name); at != NameTable::kNone; at = next_[at]) {
      ++n;
      if (!fn(*values_[at])) break;
    }
    return n;
  }
  bool Has(std::string_view name) const { return heads_.Find(name) != NameTable::kNone; }
  bool empty() const { return values_.empty(); }
  void Clear();

 private:
  NameTable heads_;  // name -> its first value's index
  std::vector<const TensorSlice*> values_;
  std::vector<uint32_t> next_;  // per value: the next value of the same name, or kNone
  std::vector<uint32_t> last_;  // per value that heads a chain: its chain's last value
};

// Where a SOURCE slice of a model's tensor is registered; spelled out only in messages (100,000
// slices make no 100,000 strings).
struct SourceRef {
  const TensorSlice* slice = nullptr;
  const std::string* id = nullptr;
  const std::string* client = nullptr;  // null: a SOURCE buffer on node `*node`
  const std::string* node = nullptr;
  // e.g. "SOURCE buffer n1/llama/src-1 (client trainer-rank0)"
  std::string Who() const;
};

class SourceIndex {
 public:
  // The SOURCE slice of `tensor` (one of this node's where there is one), or null.
  const SourceRef* Find(std::string_view tensor) const {
    return Find(tensor, NameTable::Hash(tensor));
  }
  const SourceRef* Find(std::string_view tensor, uint64_t hash) const {
    if (!MayHold(hash)) return nullptr;  // most names a source does not have stop here
    const uint32_t at = by_name_.Find(tensor, hash);
    return at == NameTable::kNone ? nullptr : &refs_[at];
  }
  // False when no source slice has a name of `hash` (a filter of two bits per name in a bitmap
  // of >= 16 bits per name: it stays in the L2 cache where the table does not, so a name that
  // is not a source tensor, e.g. each fp8 weight's scale tensor, costs no cache miss).
  bool MayHold(uint64_t hash) const {
    if (filter_.empty()) return false;
    const uint64_t a = (hash >> 8) & filter_mask_;
    const uint64_t b = (hash >> 36) & filter_mask_;
    return ((filter_[a >> 6] >> (a & 63)) & (filter_[b >> 6] >> (b & 63)) & 1) != 0;
  }
  const NameTable& by_name() const { return by_name_; }  // for prefetching
  // A local SOURCE buffer's slices (its id and client outlive their entries): they replace
  // other nodes' slices of the same tensors.
  void AddLocal(const std::string& id, const std::string& client,
                const std::vector<TensorSlice>& slices);
  // A SOURCE layout of node `node` (copied: the model's record of it may be replaced while the
  // index still holds these slices, which it keeps alive).
  void AddRemote(const std::string& node, const std::string& buffer_id,
                 std::shared_ptr<const std::vector<TensorSlice>> slices);
  // The other nodes' layouts indexed, in the order added.
  const std::vector<std::shared_ptr<const std::vector<TensorSlice>>>& remote() const {
    return remote_;
  }
  void Clear();
  // False until built, and after Invalidate (a local SOURCE buffer was released).
  bool valid() const { return valid_; }
  void set_valid() { valid_ = true; }
  void Invalidate() { valid_ = false; }

 private:
  // Room in the filter for `names` names; rebuilt (each name hashed again) when it grows.
  void SizeFilter(size_t names);
  void Note(uint64_t hash) {
    const uint64_t a = (hash >> 8) & filter_mask_;
    const uint64_t b = (hash >> 36) & filter_mask_;
    filter_[a >> 6] |= uint64_t{1} << (a & 63);
    filter_[b >> 6] |= uint64_t{1} << (b & 63);
  }

  NameTable by_name_;  // tensor -> index into refs_
  std::vector<SourceRef> refs_;
  std::vector<uint64_t> filter_;  // MayHold's bitmap: a power of two of bits
  uint64_t filter_mask_ = 0;      // its bits - 1
  std::vector<std::shared_ptr<const std::vector<TensorSlice>>> remote_;
  std::deque<std::string> names_;  // other nodes' names and buffer ids (stable addresses)
  bool valid_ = false;
};

// Built part by part when first needed (most registrations need neither part: an engine's
// first buffer has nothing registered before it), then kept up to date as buffers are added;
// Clear (a DESTINATION buffer released) forgets both.
class DestinationIndex {
 public:
  // Adds a DESTINATION buffer's slices (they outlive their entries) to the parts built.
  void Add(const std::vector<TensorSlice>& slices);
  // Builds a part from the model's DESTINATION buffers' slices, when it is not built.
  void BuildSlices(const std::vector<const std::vector<TensorSlice>*>& buffers);
  void BuildScaled(const std::vector<const std::vector<TensorSlice>*>& buffers);
  bool has_slices() const { return has_slices_; }
  bool has_scaled() const { return has_scaled_; }
  void Clear();
  // Every DESTINATION slice of each tensor (BuildSlices).
  const NameChains& slices() const { return slices_; }
  // The scaled fp8 slices by scale tensor (BuildScaled).
  const NameChains& scaled() const { return scaled_; }
  bool IsScaleTensor(std::string_view name) const { return scaled_.Has(name); }

 private:
  NameChains slices_;
  NameChains scaled_;
  bool has_slices_ = false;
  bool has_scaled_ = false;
};

}  // namespace refit
