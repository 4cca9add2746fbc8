#include "core/process.h"

#include <signal.h>

#include <cerrno>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

namespace spillway {

std::optional<uint64_t> process_start_ticks(int64_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto paren = text.rfind(')');
  if (paren == std::string::npos) return std::nullopt;
  std::istringstream fields(text.substr(paren + 1));
  std::string field;
  for (int i = 3; i <= 22; ++i)  // fields 1 and 2 are "pid (comm)"
    if (!(fields >> field)) return std::nullopt;
  try {
    return std::stoull(field);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

bool process_alive(int64_t pid, std::optional<uint64_t> start_ticks) {
  if (pid <= 0 || pid > INT32_MAX) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM) return false;  // ESRCH: gone
  if (start_ticks) {
    auto now = process_start_ticks(pid);
    if (now && *now != *start_ticks) return false;  // the pid now names another process
  }
  return true;
}

}  // namespace spillway
