#include "daemon/memory/fault_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <mutex>

#include "daemon/common/mutex.h"

namespace refit {
namespace {

struct Entry {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};  // 0: free
  std::atomic<bool> broken{false};
};

Entry g_table[FaultGuard::kMaxGuarded];
std::atomic<int> g_high{0};  // slots below this may be in use
std::atomic<uint64_t> g_hits{0};
common::Mutex g_claim_mu;  // claiming and freeing slots (never in the handler)
struct sigaction g_previous;

void Handler(int signal, siginfo_t* info, void* context) {
  const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
  const int high = g_high.load(std::memory_order_acquire);
  for (int i = 0; i < high; ++i) {
    Entry& e = g_table[i];
    const uintptr_t end = e.end.load(std::memory_order_acquire);
    const uintptr_t begin = e.begin.load(std::memory_order_acquire);
    if (end == 0 || address < begin || address >= end) continue;
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t from = address & ~(page - 1);
    // Zero pages over the rest of the range: the faulting access and every later one succeed.
    void* mapped = mmap(reinterpret_cast<void*>(from), end - from, PROT_READ | PROT_WRITE,
                        MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) break;  // fall through to the default action
    e.broken.store(true, std::memory_order_release);
    g_hits.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  // Not client memory: a real fault. Let the previous disposition (default: core dump) have it.
  if (g_previous.sa_flags & SA_SIGINFO && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(signal, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN &&
      g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(signal);
    return;
  }
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  sigaction(SIGBUS, &fallback, nullptr);
  raise(SIGBUS);
}

}  // namespace

void InstallFaultGuard() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action {};
    action.sa_sigaction = Handler;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    sigaction(SIGBUS, &action, &g_previous);
  });
}

FaultGuard::FaultGuard(void* begin, size_t length) {
  InstallFaultGuard();
  common::MutexLock lock(g_claim_mu);
  for (int i = 0; i < kMaxGuarded; ++i) {
    Entry& e = g_table[i];
    if (e.end.load(std::memory_order_relaxed) != 0) continue;
    e.broken.store(false, std::memory_order_relaxed);
    e.begin.store(reinterpret_cast<uintptr_t>(begin), std::memory_order_relaxed);
    e.end.store(reinterpret_cast<uintptr_t>(begin) + length, std::memory_order_release);
    if (i >= g_high.load(std::memory_order_relaxed)) {
      g_high.store(i + 1, std::memory_order_release);
    }
    slot_ = i;
    return;
  }
}

FaultGuard::~FaultGuard() {
  if (slot_ < 0) return;
  common::MutexLock lock(g_claim_mu);
  g_table[slot_].end.store(0, std::memory_order_release);
}

bool FaultGuard::Broken() const {
  return slot_ >= 0 && g_table[slot_].broken.load(std::memory_order_acquire);
}

uint64_t FaultGuardHits() { return g_hits.load(std::memory_order_relaxed); }

}  // namespace refit
