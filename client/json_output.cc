#include "client/json_output.h"

#include <cmath>
#include <map>

#include "google/protobuf/descriptor.h"

namespace refit::client {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

std::string Base64(const std::string& bytes) {
  static const char kDigits[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const uint32_t v =
        (uint8_t(bytes[i]) << 16) | (uint8_t(bytes[i + 1]) << 8) | uint8_t(bytes[i + 2]);
    for (int shift : {18, 12, 6, 0}) out += kDigits[(v >> shift) & 63];
  }
  if (i < bytes.size()) {
    uint32_t v = uint8_t(bytes[i]) << 16;
    if (i + 1 < bytes.size()) v |= uint8_t(bytes[i + 1]) << 8;
    out += kDigits[(v >> 18) & 63];
    out += kDigits[(v >> 12) & 63];
    out += i + 1 < bytes.size() ? kDigits[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

nlohmann::ordered_json Double(double v) {
  if (std::isfinite(v)) return v;
  return nullptr;  // JSON has no NaN or infinity
}

// One value of `field` (element `index` of a repeated field, or the singular value).
nlohmann::ordered_json Value(const Message& m, const Reflection& r, const FieldDescriptor& f,
                             int index) {
  const bool rep = f.is_repeated();
  switch (f.cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return rep ? r.GetRepeatedInt32(m, &f, index) : r.GetInt32(m, &f);
    case FieldDescriptor::CPPTYPE_INT64:
      return rep ? r.GetRepeatedInt64(m, &f, index) : r.GetInt64(m, &f);
    case FieldDescriptor::CPPTYPE_UINT32:
      return rep ? r.GetRepeatedUInt32(m, &f, index) : r.GetUInt32(m, &f);
    case FieldDescriptor::CPPTYPE_UINT64:
      return rep ? r.GetRepeatedUInt64(m, &f, index) : r.GetUInt64(m, &f);
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return Double(rep ? r.GetRepeatedDouble(m, &f, index) : r.GetDouble(m, &f));
    case FieldDescriptor::CPPTYPE_FLOAT:
      return Double(rep ? r.GetRepeatedFloat(m, &f, index) : r.GetFloat(m, &f));
    case FieldDescriptor::CPPTYPE_BOOL:
      return rep ? r.GetRepeatedBool(m, &f, index) : r.GetBool(m, &f);
    case FieldDescriptor::CPPTYPE_ENUM:
      return (rep ? r.GetRepeatedEnum(m, &f, index) : r.GetEnum(m, &f))->name();
    case FieldDescriptor::CPPTYPE_STRING: {
      std::string s = rep ? r.GetRepeatedString(m, &f, index) : r.GetString(m, &f);
      return f.type() == FieldDescriptor::TYPE_BYTES ? Base64(s) : s;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return ToJson(rep ? r.GetRepeatedMessage(m, &f, index) : r.GetMessage(m, &f));
  }
  return nullptr;
}

}  // namespace

nlohmann::ordered_json ToJson(const Message& message) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  const auto* descriptor = message.GetDescriptor();
  const Reflection& r = *message.GetReflection();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const FieldDescriptor& f = *descriptor->field(i);
    if (f.containing_oneof() && !r.HasField(message, &f)) continue;
    if (f.is_map()) {
      // Entries come in no set order: sorted by key, so output is stable.
      std::map<std::string, nlohmann::ordered_json> entries;
      const FieldDescriptor& key = *f.message_type()->map_key();
      const FieldDescriptor& value = *f.message_type()->map_value();
      for (int j = 0; j < r.FieldSize(message, &f); ++j) {
        const Message& entry = r.GetRepeatedMessage(message, &f, j);
        const Reflection& er = *entry.GetReflection();
        nlohmann::ordered_json k = Value(entry, er, key, 0);
        entries[k.is_string() ? k.get<std::string>() : k.dump()] = Value(entry, er, value, 0);
      }
      nlohmann::ordered_json object = nlohmann::ordered_json::object();
      for (auto& [k, v] : entries) object[k] = std::move(v);
      out[f.name()] = std::move(object);
    } else if (f.is_repeated()) {
      nlohmann::ordered_json array = nlohmann::ordered_json::array();
      for (int j = 0; j < r.FieldSize(message, &f); ++j) array.push_back(Value(message, r, f, j));
      out[f.name()] = std::move(array);
    } else {
      out[f.name()] = Value(message, r, f, 0);
    }
  }
  return out;
}

std::string JsonText(const nlohmann::ordered_json& json) {
  // Invalid UTF-8 in a name (clients choose them) is replaced rather than thrown on.
  return json.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

}  // namespace refit::client
