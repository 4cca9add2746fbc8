#include "cli/machine_flag.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <thread>

#include "cli/profile.h"
#include "core/atomic_file.h"
#include "core/checksum.h"

namespace spillway::cli {

namespace {

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n')) s.pop_back();
  size_t i = 0;
  while (i < s.size() && (s[i] == ' ' || s[i] == '\t')) ++i;
  return s.substr(i);
}

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return trim(line.substr(colon + 1));
    }
  }
  return "unknown CPU";
}

// The driver version from /proc/driver/nvidia/version (sim/machine.h), "none"
// without the NVIDIA driver.
std::string nvidia_driver_version() {
  std::ifstream in("/proc/driver/nvidia/version");
  std::string line;
  if (!in || !std::getline(in, line)) return "none";
  return nvidia_driver_version_from(line);
}

}  // namespace

std::string HostIdentity::key() const {
  const std::string text = gpu + "\n" + cpu_model + "\n" + std::to_string(cores) + "\n" + driver;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(checksum64(text.data(), text.size())));
  return hex;
}

std::string HostIdentity::cpu() const { return cpu_model + ", " + std::to_string(cores) + " cores"; }

HostIdentity host_identity(const std::string& gpu_description) {
  HostIdentity id;
  // "NVIDIA H200, 139.8 GiB (device 0; cuBLASLt workspace ...)": the GPU and its size.
  id.gpu = gpu_description.substr(0, gpu_description.find(" ("));
  id.cpu_model = cpu_model_name();
  id.cores = static_cast<int>(std::thread::hardware_concurrency());
  id.driver = nvidia_driver_version();
  char name[256] = {};
  id.host_name = ::gethostname(name, sizeof name - 1) == 0 ? name : "unknown host";
  return id;
}

Result<std::string> machine_cache_path(const HostIdentity& id) {
  std::string dir;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) dir = std::string(xdg) + "/spillway";
  else if (const char* home = std::getenv("HOME"); home && *home) dir = std::string(home) + "/.cache/spillway";
  else return Status::not_found("machine cache: neither XDG_CACHE_HOME nor HOME is set; give --out or --machine FILE");
  return dir + "/machine-" + id.key() + ".json";
}

Result<Machine> measured_machine(Backend& backend, const std::string& spill_dir, bool* profiled) {
  if (profiled) *profiled = false;
  const bool cuda = backend.name() == "cuda";
  const std::string preset = cuda ? "h200" : "cpu";
  const std::string instead =
      "; --machine " + preset + " plans with a preset instead (--machine h200, cpu or a file from `spillway profile`)";
  auto path = machine_cache_path(host_identity(backend.description()));
  if (!path) return Status(path.status().code(), "--machine measured: " + path.status().message() + instead);
  struct stat st {};
  const int err = ::stat(path->c_str(), &st) == 0 ? 0 : errno;
  if (err == 0) {
    auto loaded = load_machine(*path);
    if (!loaded)
      return Status(loaded.status().code(),
                    "the cached measured machine " + *path + " does not load (remove it to profile this host again, or "
                    "run `spillway profile`): " + loaded.status().message() + instead);
    std::cerr << "spillway: machine: measured " << loaded->measured_on.date << " (" << *path << ")\n";
    return loaded;
  }
  if (err != ENOENT) {
    const Status s = errno_status("--machine measured: the cached measured machine " + *path, err);
    return Status(s.code(), s.message() + instead);
  }

  const auto started = std::chrono::steady_clock::now();
  std::cerr << "spillway: machine: no measured machine for this host; profiling it briefly (once, cached at " << *path
            << "; --machine " << preset << " skips it)\n";
  const std::string folder = parent_directory(*path);
  if (Status s = make_dirs(folder); !s.is_ok())
    return Status(s.code(), "--machine measured: the machine cache: " + s.message() + instead);
  ProfileSettings settings;
  settings.brief = true;
  settings.spill_dir = spill_dir.empty() ? folder : spill_dir;
  settings.table = stderr;
  auto m = measure_machine(backend, settings);
  if (!m) {
    if (m.status().code() == StatusCode::Interrupted) return m.status();
    return Status(m.status().code(),
                  "--machine measured: the brief profile of this host failed: " + m.status().message() + instead);
  }
  if (Status s = save_machine(*m, *path); !s.is_ok())
    return Status(s.code(), "--machine measured: writing the machine cache " + *path + ": " + s.message() + instead);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::fprintf(stderr,
               "spillway: machine: profiled in %.1f s, written to %s (used from now on; remove it to profile "
               "again, `spillway profile` measures in full)\n",
               seconds, path->c_str());
  if (profiled) *profiled = true;
  return m;
}

Result<Machine> training_machine(const std::string& flag, Backend& backend, const std::string& spill_dir) {
  const bool cuda = backend.name() == "cuda";
  const std::string which = !flag.empty() ? flag : cuda ? "measured" : "cpu";
  Machine m;
  if (which == "measured") {
    SPILLWAY_ASSIGN_OR_RETURN(m, measured_machine(backend, spill_dir));
  } else {
    auto loaded = load_machine(which);
    if (!loaded) return loaded.status().with_context("--machine");
    m = *loaded;
  }
  if (cuda) m.device_bytes = backend.device_capacity();
  return m;
}

}  // namespace spillway::cli
