// The test builds' hooks (//daemon:refitd_testing): they replace the production binary's
// no-op definitions (weak symbols in liveness.cc).

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "daemon/common/liveness.h"
#include "daemon/common/logging.h"

namespace refit {

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

}  // namespace refit
