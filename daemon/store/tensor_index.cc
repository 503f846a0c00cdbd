#include "daemon/store/tensor_index.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "daemon/common/xxh3.h"
#include "daemon/plan/scales.h"

namespace refit {

uint64_t NameTable::Hash(std::string_view name) { return XXH3_64bits(name.data(), name.size()); }

void NameTable::Reserve(size_t names) {
  size_t slots = 16;
  while (slots / 4 * 3 < names) slots *= 2;
  if (mask_ == 0 || slots > mask_ + 1) Rehash(slots);
}

size_t NameTable::Probe(std::string_view name, uint64_t hash) const {
  const uint16_t tag = static_cast<uint16_t>(hash >> 48);
  const bool is_long = name.size() >= kLong;
  const uint16_t size = is_long ? kLong : static_cast<uint16_t>(name.size());
  for (size_t at = static_cast<size_t>(hash) & mask_;; at = (at + 1) & mask_) {
    const Slot& slot = slots_[at];
    if (!slot.name) return at;
    if (slot.tag != tag || slot.size != size) continue;
    if (is_long ? *reinterpret_cast<const std::string_view*>(slot.name) == name
                : size == 0 || std::memcmp(slot.name, name.data(), size) == 0) {
      return at;
    }
  }
}

uint32_t NameTable::Find(std::string_view name, uint64_t hash) const {
  if (size_ == 0) return kNone;
  const Slot& slot = slots_[Probe(name, hash)];
  return slot.name ? slot.value : kNone;
}

uint32_t NameTable::Insert(std::string_view name, uint64_t hash, uint32_t value) {
  if (mask_ == 0 || size_ + 1 > (mask_ + 1) / 4 * 3) Rehash(mask_ == 0 ? 16 : (mask_ + 1) * 2);
  Slot& slot = slots_[Probe(name, hash)];
  if (slot.name) return slot.value;
  static const char kEmpty = 0;  // a view of no bytes may have no data pointer
  const char* bytes = name.data() ? name.data() : &kEmpty;
  uint16_t size = static_cast<uint16_t>(name.size());
  if (name.size() >= kLong) {
    long_names_.push_back(name);
    bytes = reinterpret_cast<const char*>(&long_names_.back());
    size = kLong;
  }
  slot = {bytes, size, static_cast<uint16_t>(hash >> 48), value};
  ++size_;
  return value;
}

void NameTable::Rehash(size_t slots) {
  Slot* old = slots_;
  const size_t old_count = mask_ == 0 ? 0 : mask_ + 1;
  // Zeroed memory is empty slots: for a big table calloc hands out the kernel's zeroed pages
  // (no pass to fill them).
  slots_ = static_cast<Slot*>(std::calloc(slots, sizeof(Slot)));
  if (!slots_) throw std::bad_alloc();
  mask_ = slots - 1;
  for (size_t i = 0; i < old_count; ++i) {
    const Slot& slot = old[i];
    if (!slot.name) continue;
    const std::string_view name = slot.size == kLong
                                      ? *reinterpret_cast<const std::string_view*>(slot.name)
                                      : std::string_view(slot.name, slot.size);
    size_t at = static_cast<size_t>(Hash(name)) & mask_;
    while (slots_[at].name) at = (at + 1) & mask_;
    slots_[at] = slot;
  }
  std::free(old);
}

void NameTable::Clear() {
  std::free(slots_);
  slots_ = nullptr;
  mask_ = 0;
  size_ = 0;
  long_names_.clear();
}

void NameChains::Reserve(size_t values) {
  heads_.Reserve(values);
  values_.reserve(values);
  next_.reserve(values);
  last_.reserve(values);
}

void NameChains::Add(std::string_view name, const TensorSlice* value) {
  const uint32_t at = static_cast<uint32_t>(values_.size());
  values_.push_back(value);
  next_.push_back(NameTable::kNone);
  last_.push_back(at);
  const uint32_t head = heads_.Insert(name, at);
  if (head != at) {
    next_[last_[head]] = at;
    last_[head] = at;
  }
}

void NameChains::Clear() {
  heads_.Clear();
  values_.clear();
  next_.clear();
  last_.clear();
}

std::string SourceRef::Who() const {
  if (client) {
    return absl::StrCat("SOURCE buffer ", *id, " (client ", client->empty() ? "unnamed" : *client,
                        ")");
  }
  return absl::StrCat("SOURCE buffer ", *id, " on node ", *node);
}

void SourceIndex::SizeFilter(size_t names) {
  uint64_t bits = uint64_t{1} << 12;
  while (bits < 16 * static_cast<uint64_t>(names)) bits *= 2;
  if (bits <= filter_.size() * 64) return;
  filter_.assign(bits / 64, 0);
  filter_mask_ = bits - 1;
  for (const SourceRef& ref : refs_) Note(NameTable::Hash(ref.slice->name));
}

void SourceIndex::AddLocal(const std::string& id, const std::string& client,
                           const std::vector<TensorSlice>& slices) {
  by_name_.Reserve(by_name_.size() + slices.size());
  SizeFilter(refs_.size() + slices.size());
  for (const TensorSlice& s : slices) {
    const uint32_t at = static_cast<uint32_t>(refs_.size());
    const uint64_t hash = NameTable::Hash(s.name);
    const uint32_t held = by_name_.Insert(s.name, hash, at);
    if (held == at) {
      Note(hash);
      refs_.push_back({&s, &id, &client, nullptr});
    } else if (!refs_[held].client) {
      refs_[held] = {&s, &id, &client, nullptr};  // this node's slices before other nodes'
    }
  }
}

void SourceIndex::AddRemote(const std::string& node, const std::string& buffer_id,
                            std::shared_ptr<const std::vector<TensorSlice>> slices) {
  remote_.push_back(slices);
  if (!slices) return;
  names_.push_back(node);
  const std::string* node_name = &names_.back();
  names_.push_back(buffer_id);
  const std::string* id = &names_.back();
  by_name_.Reserve(by_name_.size() + slices->size());
  SizeFilter(refs_.size() + slices->size());
  for (const TensorSlice& s : *slices) {
    const uint32_t at = static_cast<uint32_t>(refs_.size());
    const uint64_t hash = NameTable::Hash(s.name);
    if (by_name_.Insert(s.name, hash, at) == at) {
      Note(hash);
      refs_.push_back({&s, id, nullptr, node_name});
    }
  }
}

void SourceIndex::Clear() {
  by_name_.Clear();
  refs_.clear();
  filter_.clear();
  filter_mask_ = 0;
  remote_.clear();
  names_.clear();
  valid_ = false;
}

void DestinationIndex::Add(const std::vector<TensorSlice>& slices) {
  for (const TensorSlice& s : slices) {
    if (has_slices_) slices_.Add(s.name, &s);
    if (has_scaled_ && plan::IsScaled(s)) scaled_.Add(s.scale_tensor, &s);
  }
}

void DestinationIndex::BuildSlices(const std::vector<const std::vector<TensorSlice>*>& buffers) {
  if (has_slices_) return;
  size_t n = 0;
  for (const auto* slices : buffers) n += slices->size();
  slices_.Reserve(n);
  for (const auto* slices : buffers) {
    for (const TensorSlice& s : *slices) slices_.Add(s.name, &s);
  }
  has_slices_ = true;
}

void DestinationIndex::BuildScaled(const std::vector<const std::vector<TensorSlice>*>& buffers) {
  if (has_scaled_) return;
  for (const auto* slices : buffers) {
    for (const TensorSlice& s : *slices) {
      if (plan::IsScaled(s)) scaled_.Add(s.scale_tensor, &s);
    }
  }
  has_scaled_ = true;
}

void DestinationIndex::Clear() {
  slices_.Clear();
  scaled_.Clear();
  has_slices_ = false;
  has_scaled_ = false;
}

}  // namespace refit
