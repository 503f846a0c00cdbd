#pragma once

// refitctl's --json: protobuf messages as JSON objects whose numbers are JSON numbers (64-bit
// integers too, where protobuf's own JSON mapping prints them as strings), every field present
// (defaults included), proto field names, enums by name.
//
// Thread-safety: pure functions.

#include <string>

#include "google/protobuf/message.h"
#include "nlohmann/json.hpp"

namespace refit::client {

// `message` as a JSON object, fields in declaration order.
nlohmann::ordered_json ToJson(const google::protobuf::Message& message);

// ToJson(message) printed with two-space indents and a final newline.
std::string JsonText(const nlohmann::ordered_json& json);

}  // namespace refit::client
