// The test build's hooks (//daemon:refitd_testing): they replace the production binary's
// no-op definitions (weak symbols in test_hooks_off.cc).

#include "daemon/common/test_hooks.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "daemon/common/logging.h"

namespace refit {

const char* TestSwitch(const char* name) { return std::getenv(name); }

void TestHookWedge(const char* worker) {
  const char* wanted = std::getenv("REFIT_TEST_WEDGE");
  const char* file = std::getenv("REFIT_TEST_WEDGE_FILE");
  if (!wanted || !file || std::strcmp(wanted, worker) != 0) return;
  struct stat st;
  if (stat(file, &st) != 0) return;
  Logger("daemon")->warn("test hook: worker {} wedged while {} exists", worker, file);
  while (stat(file, &st) == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  Logger("daemon")->warn("test hook: worker {} goes on", worker);
}

void TestHookKillAt(const char* point) {
  const char* wanted = std::getenv("REFIT_TEST_KILL_AT");
  if (!wanted) return;
  const std::string spec = wanted;
  const size_t colon = spec.find(':');
  if (spec.substr(0, colon) != point) return;
  const char* file = std::getenv("REFIT_TEST_KILL_FILE");
  struct stat st;
  if (file && stat(file, &st) != 0) return;
  static std::atomic<long> hits{0};
  const long nth = colon == std::string::npos ? 1 : std::atol(spec.c_str() + colon + 1);
  if (++hits < nth) return;
  Logger("daemon")->warn("test hook: SIGKILL at {} (hit {})", point, hits.load());
  Logger("daemon")->flush();
  kill(getpid(), SIGKILL);
  pause();
}

}  // namespace refit
