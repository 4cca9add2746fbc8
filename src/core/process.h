// Is the process that left a file behind still running?
//
//   auto start = process_start_ticks(::getpid());        // write both into a marker
//   ... later, maybe in another process:
//   if (!process_alive(pid, start)) { /* its files are leftovers */ }
#pragma once

#include <cstdint>
#include <optional>

namespace spillway {

// Field 22 of /proc/<pid>/stat: when the process started, in clock ticks since
// boot. With the pid it names a process uniquely (pids are reused). nullopt when the
// process is gone or /proc cannot tell.
std::optional<uint64_t> process_start_ticks(int64_t pid);

// False when no process has `pid` (or pid <= 0), or when `start_ticks` is given and
// the process with that pid started at another time (the pid was reused). A process
// we may not signal (EPERM) counts as alive.
bool process_alive(int64_t pid, std::optional<uint64_t> start_ticks = std::nullopt);

}  // namespace spillway
