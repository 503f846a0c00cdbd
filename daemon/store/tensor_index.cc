#include "daemon/store/tensor_index.h"

#include "absl/strings/str_cat.h"
#include "daemon/common/xxh3.h"
#include "daemon/plan/scales.h"

namespace refit {

uint64_t NameTable::Hash(std::string_view name) { return XXH3_64bits(name.data(), name.size()); }

void NameTable::Reserve(size_t names) {
  size_t slots = 16;
  while (slots / 4 * 3 < names) slots *= 2;
  if (slots > slots_.size()) Rehash(slots);
}

size_t NameTable::Probe(std::string_view name, uint64_t hash) const {
  const size_t mask = slots_.size() - 1;
  const uint32_t tag = static_cast<uint32_t>(hash >> 32);
  for (size_t at = static_cast<size_t>(hash) & mask;; at = (at + 1) & mask) {
    const Slot& slot = slots_[at];
    if (slot.value == kNone) return at;
    if (slot.tag == tag && std::string_view(slot.name, slot.size) == name) return at;
  }
}

uint32_t NameTable::Find(std::string_view name, uint64_t hash) const {
  if (size_ == 0) return kNone;
  return slots_[Probe(name, hash)].value;
}

uint32_t NameTable::Insert(std::string_view name, uint64_t hash, uint32_t value) {
  if (size_ + 1 > slots_.size() / 4 * 3) Rehash(slots_.empty() ? 16 : slots_.size() * 2);
  Slot& slot = slots_[Probe(name, hash)];
  if (slot.value != kNone) return slot.value;
  slot = {name.data(), static_cast<uint32_t>(name.size()), static_cast<uint32_t>(hash >> 32),
          value};
  ++size_;
  return value;
}

void NameTable::Rehash(size_t slots) {
  std::vector<Slot> old(slots, Slot{});
  old.swap(slots_);
  const size_t mask = slots - 1;
  for (const Slot& slot : old) {
    if (slot.value == kNone) continue;
    size_t at = static_cast<size_t>(Hash(std::string_view(slot.name, slot.size))) & mask;
    while (slots_[at].value != kNone) at = (at + 1) & mask;
    slots_[at] = slot;
  }
}

void NameTable::Clear() {
  slots_.clear();
  size_ = 0;
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

void SourceIndex::AddLocal(const std::string& id, const std::string& client,
                           const std::vector<TensorSlice>& slices) {
  by_name_.Reserve(by_name_.size() + slices.size());
  for (const TensorSlice& s : slices) {
    const uint32_t at = static_cast<uint32_t>(refs_.size());
    const uint32_t held = by_name_.Insert(s.name, at);
    if (held == at) {
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
  for (const TensorSlice& s : *slices) {
    const uint32_t at = static_cast<uint32_t>(refs_.size());
    if (by_name_.Insert(s.name, at) == at) refs_.push_back({&s, id, nullptr, node_name});
  }
}

void SourceIndex::Clear() {
  by_name_.Clear();
  refs_.clear();
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
