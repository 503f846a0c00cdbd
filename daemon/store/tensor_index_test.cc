// The model's tensors by name (tensor_index.h): NameTable's open addressing (probe chains,
// growth, names too long for a slot's length field), and SourceIndex's filter, which must never
// hide a name a SOURCE slice has.

#include "daemon/store/tensor_index.h"

#include <memory>
#include <string>
#include <vector>

#include "catch2/catch.hpp"

namespace refit {
namespace {

TensorSlice Named(std::string name) {
  TensorSlice s;
  s.name = std::move(name);
  s.dtype = DType::kBF16;
  s.global_shape = {4};
  return s;
}

TEST_CASE("NameTable finds every name it holds, and none it does not, across growth") {
  std::vector<std::string> names;
  for (int i = 0; i < 5000; ++i) names.push_back("model.layers." + std::to_string(i) + ".w");
  NameTable table;  // no Reserve: grows from 16 slots
  for (uint32_t i = 0; i < names.size(); ++i) {
    REQUIRE(table.Insert(names[i], i) == i);
  }
  REQUIRE(table.size() == names.size());
  for (uint32_t i = 0; i < names.size(); ++i) {
    REQUIRE(table.Find(names[i]) == i);
    REQUIRE(table.Insert(names[i], 99999) == i);  // the earlier value stays
  }
  REQUIRE(table.size() == names.size());
  CHECK(table.Find("model.layers.5000.w") == NameTable::kNone);
  CHECK(table.Find("model.layers.1.") == NameTable::kNone);  // a prefix of a held name
  CHECK(table.Find("") == NameTable::kNone);
  table.Clear();
  CHECK(table.empty());
  CHECK(table.Find(names[0]) == NameTable::kNone);
}

TEST_CASE("NameTable tells apart names of 65,535 bytes and more, and names with NUL bytes") {
  const std::string long_a(70000, 'a');
  std::string long_b = long_a;
  long_b.back() = 'b';
  const std::string edge(65535, 'a');
  const std::string with_nul("a\0b", 3);
  NameTable table;
  table.Reserve(8);
  REQUIRE(table.Insert(long_a, 1) == 1);
  REQUIRE(table.Insert(long_b, 2) == 2);
  REQUIRE(table.Insert(edge, 3) == 3);
  REQUIRE(table.Insert(with_nul, 4) == 4);
  REQUIRE(table.Insert("a", 5) == 5);
  // Growth moves the long names' slots too.
  for (uint32_t i = 0; i < 100; ++i) table.Insert("n" + std::to_string(i), 100 + i);
  CHECK(table.Find(long_a) == 1);
  CHECK(table.Find(long_b) == 2);
  CHECK(table.Find(edge) == 3);
  CHECK(table.Find(with_nul) == 4);
  CHECK(table.Find("a") == 5);
  CHECK(table.Find(std::string(70001, 'a')) == NameTable::kNone);
  CHECK(table.Find(std::string("a\0c", 3)) == NameTable::kNone);
}

TEST_CASE("SourceIndex finds every source tensor through its filter, local and remote") {
  const std::string id = "n/m/src-1", client = "trainer";
  std::vector<TensorSlice> first, second;
  for (int i = 0; i < 300; ++i) first.push_back(Named("a." + std::to_string(i)));
  // The second buffer makes the index (and its filter) grow past what the first sized.
  for (int i = 0; i < 20000; ++i) second.push_back(Named("b." + std::to_string(i)));
  auto remote = std::make_shared<std::vector<TensorSlice>>();
  for (int i = 0; i < 40; ++i) remote->push_back(Named("r." + std::to_string(i)));
  remote->push_back(Named("a.7"));  // this node's slice of it wins

  SourceIndex index;
  CHECK(index.Find("a.0") == nullptr);  // empty
  index.AddLocal(id, client, first);
  index.AddRemote("n2", "n2/m/src-1", remote);
  index.AddLocal(id, client, second);
  for (const auto* slices : {&first, &second}) {
    for (const TensorSlice& s : *slices) {
      const SourceRef* ref = index.Find(s.name);
      REQUIRE(ref != nullptr);
      REQUIRE(ref->slice == &s);
    }
  }
  for (int i = 0; i < 40; ++i) {
    const SourceRef* ref = index.Find("r." + std::to_string(i));
    REQUIRE(ref != nullptr);
    CHECK(ref->client == nullptr);
    CHECK(*ref->node == "n2");
  }
  CHECK(index.Find("a.7")->slice == &first[7]);
  // Names no source has: none found (the filter or the table says so).
  int filtered = 0;
  for (int i = 0; i < 20000; ++i) {
    const std::string absent = "b." + std::to_string(i) + "_scale_inv";
    CHECK(index.Find(absent) == nullptr);
    if (!index.MayHold(NameTable::Hash(absent))) ++filtered;
  }
  CHECK(filtered > 19000);  // >= 16 bits per name: a few percent pass the filter
  index.Clear();
  CHECK(index.Find("a.0") == nullptr);
}

}  // namespace
}  // namespace refit
