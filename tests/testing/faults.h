#pragma once

// Shared by the fault suite (tests/faults_*_test.cc, docs/faults.md): how many iterations a
// run does (small by default, scripts/faults.sh asks for the long counts), figures printed as
// "FIGURE name ..." lines that scripts/faults.sh collects, and refitd's own /dev/shm objects.
//
// Not thread-safe unless said otherwise.

#include <sys/types.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "client/refit_client.h"

namespace refit::testing {

// $REFIT_FAULTS_ITERATIONS when set (scripts/faults.sh), else `fallback`.
int Iterations(int fallback);

// Prints "FIGURE <name> n=<count> median=<m> max=<x> <unit>" on stdout.
void PrintFigure(const std::string& name, std::vector<double> values, const std::string& unit);
// Prints "FIGURE <name> <text>".
void PrintFigureText(const std::string& name, const std::string& text);

// Fills `memory` with bytes from `seed` (a version's pattern).
void FillPattern(client::SharedMemory& memory, uint64_t seed);
// True when `memory` holds exactly FillPattern(seed)'s bytes.
bool HoldsPattern(const client::SharedMemory& memory, uint64_t seed);

// The /dev/shm objects process `pid` has open or mapped (names under /dev/shm, "(deleted)"
// ones left out: they are gone already), except the tests' own (/dev/shm/refit-test-...).
std::set<std::string> ShmObjectsOf(pid_t pid);
// Of `names`, those still present in /dev/shm.
std::set<std::string> StillInShm(const std::set<std::string>& names);

// A counter or gauge from Status().metrics; -1 when absent.
double Metric(client::Client& client, const std::string& name);

// Seconds since an arbitrary start (steady clock).
double Now();

}  // namespace refit::testing
