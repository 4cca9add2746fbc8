#include "dist/rank_env.h"

#include <fcntl.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <system_error>
#include <thread>

#include "core/atomic_file.h"
#include "core/process.h"

namespace spillway {

namespace {

constexpr int kMostRanks = 1 << 20;
constexpr const char* kRendezvousTag = "spillway-rendezvous-v1";

// A variable as a whole number in [lo, kMostRanks]; nullopt when unset.
Result<std::optional<int>> whole_number(const EnvLookup& lookup, const char* name, int lo, const std::string& expected) {
  const char* v = lookup(name);
  if (v == nullptr) return std::optional<int>();
  const std::string text = v;
  auto bad = [&]() {
    return Status::invalid_argument(std::string(name) + "='" + text + "': expected " + expected);
  };
  if (text.empty() || text.size() > 9 || text.find_first_not_of("0123456789") != std::string::npos) return bad();
  const long n = std::strtol(text.c_str(), nullptr, 10);
  if (n < lo || n > kMostRanks) return bad();
  return std::optional<int>(static_cast<int>(n));
}

std::string text_of(const EnvLookup& lookup, const char* name) {
  const char* v = lookup(name);
  return v ? v : "";
}

}  // namespace

Result<RankEnv> rank_env(const EnvLookup& lookup) {
  RankEnv env;
  env.nccl_id = text_of(lookup, "SPILLWAY_NCCL_ID");
  env.rendezvous_dir = text_of(lookup, "SPILLWAY_RENDEZVOUS_DIR");
  env.master_port = text_of(lookup, "MASTER_PORT");
  env.run_id = text_of(lookup, "TORCHELASTIC_RUN_ID");
  const char* world_text = lookup("WORLD_SIZE");
  if (world_text == nullptr || *world_text == '\0') {
    // One process alone; a RANK beside it must say so.
    SPILLWAY_ASSIGN_OR_RETURN(std::optional<int> rank, whole_number(lookup, "RANK", 0, "a whole number"));
    if (rank && *rank != 0)
      return Status::invalid_argument("RANK=" + std::to_string(*rank) +
                                      " but WORLD_SIZE is not set: a data-parallel job needs WORLD_SIZE (the number "
                                      "of ranks) beside RANK and LOCAL_RANK");
    return env;
  }
  SPILLWAY_ASSIGN_OR_RETURN(std::optional<int> world,
                            whole_number(lookup, "WORLD_SIZE", 1,
                                         "the number of ranks, a whole number from 1 to " + std::to_string(kMostRanks)));
  env.world = *world;
  if (env.world == 1) {
    SPILLWAY_ASSIGN_OR_RETURN(std::optional<int> rank, whole_number(lookup, "RANK", 0, "0 (WORLD_SIZE is 1)"));
    if (rank && *rank != 0)
      return Status::invalid_argument("RANK=" + std::to_string(*rank) + ": expected 0 (WORLD_SIZE is 1)");
    return env;
  }
  const std::string ranks = "a whole number from 0 to " + std::to_string(env.world - 1) + " (WORLD_SIZE is " +
                            std::to_string(env.world) + ")";
  SPILLWAY_ASSIGN_OR_RETURN(std::optional<int> rank, whole_number(lookup, "RANK", 0, ranks));
  if (!rank) return Status::invalid_argument("WORLD_SIZE=" + std::to_string(env.world) + " but RANK is not set: expected " + ranks);
  if (*rank >= env.world) return Status::invalid_argument("RANK=" + std::to_string(*rank) + ": expected " + ranks);
  env.rank = *rank;
  SPILLWAY_ASSIGN_OR_RETURN(std::optional<int> local_world,
                            whole_number(lookup, "LOCAL_WORLD_SIZE", 1, "the ranks on this machine, a whole number >= 1"));
  const int local_bound = local_world ? *local_world : env.world;
  const std::string locals = "this rank's device on its machine, a whole number from 0 to " +
                             std::to_string(local_bound - 1) +
                             (local_world ? " (LOCAL_WORLD_SIZE is " : " (WORLD_SIZE is ") + std::to_string(local_bound) + ")";
  SPILLWAY_ASSIGN_OR_RETURN(std::optional<int> local, whole_number(lookup, "LOCAL_RANK", 0, locals));
  if (!local)
    return Status::invalid_argument("WORLD_SIZE=" + std::to_string(env.world) + " but LOCAL_RANK is not set: expected " +
                                    locals);
  if (*local >= local_bound) return Status::invalid_argument("LOCAL_RANK=" + std::to_string(*local) + ": expected " + locals);
  env.local_rank = *local;
  return env;
}

Result<RankEnv> rank_env() {
  return rank_env([](const char* name) -> const char* { return std::getenv(name); });
}

std::string rendezvous_path(const RankEnv& env) {
  std::string dir = env.rendezvous_dir;
  if (dir.empty()) {
    std::error_code ec;
    const std::filesystem::path tmp = std::filesystem::temp_directory_path(ec);
    dir = ec ? "/tmp" : tmp.string();
  }
  // Only characters that are safe in a file name (the parts come from the environment).
  auto safe = [](const std::string& s) {
    std::string out;
    for (char c : s) out += (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.') ? c : '_';
    return out;
  };
  std::string name = "spillway-rendezvous";
  if (!env.master_port.empty()) name += "-" + safe(env.master_port);
  if (!env.run_id.empty()) name += "-" + safe(env.run_id);
  name += "-" + std::to_string(env.world);
  return (std::filesystem::path(dir) / name).string();
}

Status publish_rendezvous(const std::string& path, const std::string& text) {
  if (text.find('\n') != std::string::npos)
    return Status::invalid_argument("rendezvous " + path + ": the text to hand over holds a newline");
  const std::optional<uint64_t> start = process_start_ticks(::getpid());
  const std::string line = std::string(kRendezvousTag) + " " + std::to_string(::getpid()) + " " +
                           std::to_string(start ? *start : 0) + " " + text + "\n";
  return write_file_atomically(path, line).with_context("rendezvous " + path);
}

Result<std::string> await_rendezvous(const std::string& path, std::chrono::milliseconds timeout) {
  const auto start = std::chrono::steady_clock::now();
  std::string seen;  // why the last file read was passed over, for the timeout's message
  for (;;) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 && errno != ENOENT) return errno_status("rendezvous: open " + path, errno);
    if (fd >= 0) {
      std::string line;
      char buf[512];
      for (;;) {
        const ssize_t n = ::read(fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
          const int err = errno;
          ::close(fd);
          return errno_status("rendezvous: read " + path, err);
        }
        if (n == 0 || line.size() > 4096) break;
        line.append(buf, static_cast<size_t>(n));
      }
      ::close(fd);
      if (const size_t nl = line.find('\n'); nl != std::string::npos) line.resize(nl);
      std::istringstream fields(line);
      std::string tag, text;
      long long pid = 0;
      unsigned long long ticks = 0;
      if (!(fields >> tag >> pid >> ticks) || tag != kRendezvousTag || pid <= 0 || fields.get() != ' ')
        return Status::corrupt("rendezvous " + path + ": not a file spillway wrote (first line '" + line.substr(0, 80) +
                               "'); remove it, or set SPILLWAY_RENDEZVOUS_DIR to another folder");
      std::getline(fields, text);
      if (process_alive(pid, ticks ? std::optional<uint64_t>(ticks) : std::nullopt)) return text;
      seen = "; " + path + " is there, but its writer (pid " + std::to_string(pid) +
             ") is gone: a finished job's, waited past";
    }
    const auto waited = std::chrono::steady_clock::now() - start;
    if (waited >= timeout)
      return Status::io_error(
          "rendezvous: waited " + std::to_string(std::chrono::duration_cast<std::chrono::seconds>(waited).count()) +
          " s for rank 0 to write the job's id into " + path + seen +
          " (did rank 0 start, on this machine, with the same SPILLWAY_RENDEZVOUS_DIR, MASTER_PORT and "
          "TORCHELASTIC_RUN_ID? Ranks on several machines need SPILLWAY_NCCL_ID set by the launcher)");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

Status remove_rendezvous(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return errno_status("rendezvous: remove " + path, errno);
  return Status::ok();
}

}  // namespace spillway
