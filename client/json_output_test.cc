#include "client/json_output.h"

#include "catch2/catch.hpp"
#include "proto/refit/v1/refit.pb.h"

namespace refit::client {
namespace {

TEST_CASE("64-bit numbers are JSON numbers, defaults included", "[json]") {
  v1::StatusResponse status;
  status.set_node("n1");
  v1::ModelStatus* m = status.add_models();
  m->set_model("llama");
  m->set_latest_version(18446744073709551615ull);
  m->add_versions(7);
  m->add_versions(8);
  m->set_version_bytes(uint64_t{5} << 40);
  v1::BufferStatus* b = m->add_buffers();
  b->set_role(v1::DESTINATION);
  (*status.mutable_metrics())["b"] = 2.5;
  (*status.mutable_metrics())["a"] = 1;
  const auto json = ToJson(status);
  const auto& model = json["models"][0];
  CHECK(model["latest_version"].is_number_unsigned());
  CHECK(model["latest_version"].get<uint64_t>() == 18446744073709551615ull);
  CHECK(model["versions"] == nlohmann::ordered_json::array({7, 8}));
  CHECK(model["version_bytes"].get<uint64_t>() == (uint64_t{5} << 40));
  CHECK(model["abandoned_version"] == 0);  // default still printed
  CHECK(model["buffers"][0]["role"] == "DESTINATION");
  CHECK(model["buffers"][0]["client"] == "");
  CHECK(json["metrics"]["a"] == 1.0);
  CHECK(json["metrics"].begin().key() == "a");  // map keys sorted
  CHECK(json["listen_port"].is_number_integer());
  const std::string text = JsonText(json);
  CHECK(text.find("\"latest_version\": 18446744073709551615") != std::string::npos);
  CHECK(text.back() == '\n');
}

TEST_CASE("a oneof prints only the member that is set; bytes as base64", "[json]") {
  v1::MemoryHandle memory;
  memory.mutable_cuda_ipc()->set_handle(std::string("\x01\x02\x03\x04", 4));
  const auto json = ToJson(memory);
  CHECK(json.contains("cuda_ipc"));
  CHECK_FALSE(json.contains("host_shm"));
  CHECK(json["cuda_ipc"]["handle"] == "AQIDBA==");
}

}  // namespace
}  // namespace refit::client
