#include "daemon/common/logging.h"

#include "daemon/common/mutex.h"
#include "spdlog/sinks/stdout_color_sinks.h"

namespace refit {
namespace {

common::Mutex& LoggerMutex() {
  static common::Mutex mu;
  return mu;
}

spdlog::level::level_enum& CurrentLevel() {
  static spdlog::level::level_enum level = spdlog::level::info;
  return level;
}

}  // namespace

std::shared_ptr<spdlog::logger> Logger(const std::string& component) {
  common::MutexLock lock(LoggerMutex());
  if (auto existing = spdlog::get(component)) return existing;
  auto logger = spdlog::stderr_color_mt(component);
  logger->set_level(CurrentLevel());
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ [%n] %v");
  return logger;
}

bool SetLogLevel(const std::string& level) {
  auto parsed = spdlog::level::from_str(level);
  if (parsed == spdlog::level::off && level != "off") return false;
  common::MutexLock lock(LoggerMutex());
  CurrentLevel() = parsed;
  spdlog::apply_all([parsed](std::shared_ptr<spdlog::logger> l) { l->set_level(parsed); });
  return true;
}

}  // namespace refit
