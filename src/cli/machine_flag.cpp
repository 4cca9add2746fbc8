#include "cli/machine_flag.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <thread>

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

Result<Machine> training_machine(const std::string& flag, const Backend& backend) {
  const bool cuda = backend.name() == "cuda";
  Machine m;
  if (!flag.empty()) {
    auto loaded = load_machine(flag);
    if (!loaded) return loaded.status().with_context("--machine");
    m = *loaded;
  } else if (!cuda) {
    m = Machine::cpu_dev_box();
  } else {
    const HostIdentity id = host_identity(backend.description());
    auto path = machine_cache_path(id);
    struct stat st {};
    if (path.ok() && ::stat(path->c_str(), &st) == 0) {
      auto loaded = load_machine(*path);
      if (!loaded) return loaded.status().with_context("the cached measured machine (remove it or profile again)");
      m = *loaded;
      std::cerr << "spillway: machine: measured " << m.measured_on.date << " (" << *path << ")\n";
    } else {
      m = Machine::h200();
      std::cerr << "spillway: machine: no measured machine for this host"
                << (path.ok() ? " at " + *path : std::string()) << "; planning with the h200 preset ("
                << "`spillway profile --backend cuda --spill-dir DIR` measures this one and caches it)\n";
    }
  }
  if (cuda) m.device_bytes = backend.device_capacity();
  return m;
}

}  // namespace spillway::cli
