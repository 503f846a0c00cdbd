#include "daemon/common/names.h"

#include "catch2/catch.hpp"

namespace refit {
namespace {

TEST_CASE("EditDistance counts single-byte edits", "[names]") {
  CHECK(EditDistance("", "") == 0);
  CHECK(EditDistance("llama", "llama") == 0);
  CHECK(EditDistance("lama", "llama") == 1);
  CHECK(EditDistance("llmaa", "llama") == 2);
  CHECK(EditDistance("kitten", "sitting") == 3);
  CHECK(EditDistance("", "abc") == 3);
}

TEST_CASE("NearestName proposes a plausible typo only", "[names]") {
  const std::vector<std::string> known = {"llama-8b", "qwen-7b", "mistral"};
  CHECK(NearestName("lama-8b", known) == "llama-8b");
  CHECK(NearestName("qwen-7B", known) == "qwen-7b");
  CHECK(NearestName("gpt", known).empty());
  CHECK(NearestName("llama-8b", known).empty());  // the name itself is no suggestion
}

TEST_CASE("KnownModelsHint lists the others and the nearest", "[names]") {
  CHECK(KnownModelsHint("lama", {"llama", "lama"}) ==
        " (known models: llama; did you mean 'llama'?)");
  CHECK(KnownModelsHint("x", {}) == " (this node knows no other model)");
  CHECK(KnownModelsHint("zzz", {"llama"}) == " (known models: llama)");
}

}  // namespace
}  // namespace refit
