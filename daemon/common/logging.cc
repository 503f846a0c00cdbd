#include "daemon/common/logging.h"

#include <mutex>

#include "spdlog/sinks/stdout_color_sinks.h"

namespace refit {
namespace {

std::mutex& LoggerMutex() {
  static std::mutex mu;
  return mu;
}

spdlog::level::level_enum& CurrentLevel() {
  static spdlog::level::level_enum level = spdlog::level::info;
  return level;
}

}  // namespace

std::shared_ptr<spdlog::logger> Logger(const std::string& component) {
  std::lock_guard<std::mutex> lock(LoggerMutex());
  if (auto existing = spdlog::get(component)) return existing;
  auto logger = spdlog::stderr_color_mt(component);
  logger->set_level(CurrentLevel());
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ [%n] %v");
  return logger;
}

bool SetLogLevel(const std::string& level) {
  auto parsed = spdlog::level::from_str(level);
  if (parsed == spdlog::level::off && level != "off") return false;
  std::lock_guard<std::mutex> lock(LoggerMutex());
  CurrentLevel() = parsed;
  spdlog::apply_all([parsed](std::shared_ptr<spdlog::logger> l) { l->set_level(parsed); });
  return true;
}

}  // namespace refit
