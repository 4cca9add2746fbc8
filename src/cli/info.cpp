// `spillway info`: what this build and this machine offer.
//
//   spillway info
#include <cstdio>
#include <thread>

#include "backend/backend.h"
#include "cli/command.h"
#include "cli/train_flags.h"
#include "core/size.h"
#include "model/model.h"
#include "optim/adamw.h"

namespace spillway::cli {
namespace {

int run_info() {
#ifdef SPILLWAY_HAVE_CUDA
  const bool cuda_built = true;
#else
  const bool cuda_built = false;
#endif
#ifdef SPILLWAY_HAVE_URING
  const bool uring_built = true;
#else
  const bool uring_built = false;
#endif
  std::printf("build: CUDA backend %s, io_uring %s, host AdamW kernel %s\n", cuda_built ? "yes" : "no",
              uring_built ? "yes" : "no (thread-pool pread/pwrite)", simd_level_name(adamw_simd_level()));
  std::printf("cpu: %u hardware threads\n", std::thread::hardware_concurrency());
  auto host = available_host_memory();
  if (host.ok()) std::printf("host memory: %s available (default --host-budget %s)\n",
                             format_size(*host).c_str(), format_size(*host / 10 * 8).c_str());
  else std::printf("host memory: unknown (%s)\n", host.status().message().c_str());

  std::printf("backends:\n");
  auto cpu = make_backend("cpu");
  if (cpu.ok()) std::printf("  cpu   %s\n", (*cpu)->description().c_str());
  else std::printf("  cpu   unavailable: %s\n", cpu.status().message().c_str());
  if (cuda_available()) {
    auto cuda = make_backend("cuda");
    if (cuda.ok())
      std::printf("  cuda  %s (%s free)\n", (*cuda)->description().c_str(),
                  format_size((*cuda)->device_free_bytes()).c_str());
    else std::printf("  cuda  unavailable: %s\n", cuda.status().message().c_str());
  } else {
    std::printf("  cuda  unavailable: %s\n", cuda_built ? "no GPU found" : "not built (nvcc was not found)");
  }

  std::printf("model presets:\n");
  for (const std::string& name : model_preset_names()) {
    auto cfg = model_preset(name);
    if (!cfg.ok()) continue;
    const double params = static_cast<double>(cfg->num_parameters());
    // Training state per parameter: param + grad (bf16 on CUDA) + master, m, v (F32).
    std::printf("  %-13s %8s parameters  %s  (training state %s with bf16)\n", name.c_str(),
                format_count(params).c_str(), cfg->to_string().c_str(),
                format_size(static_cast<uint64_t>(params * 16)).c_str());
  }
  return 0;
}

CommandRegistration info_command("info", "build options, backends, GPU, CPU threads and model presets",
                                 [](CLI::App&) -> CommandRun { return [] { return run_info(); }; });

}  // namespace
}  // namespace spillway::cli
