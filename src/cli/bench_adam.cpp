// `spillway bench adam`: host AdamW throughput, per SIMD level, on state that does
// not fit in cache.
//
//   spillway bench adam --params 1e9 --threads 16 --dtype bf16
//   spillway bench adam --params 1e9 --into     (out of place, as speculative updates)
//
// Allocates master, m, v (F32) and param, grad (--dtype), touches every page first
// from the threads that will update it (untimed), then times --iters steps per
// level after one warm-up step.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "core/size.h"
#include "core/thread_pool.h"
#include "optim/adamw.h"
#include "sim/profiler.h"

namespace spillway::cli {
namespace {

struct Options {
  double params = 1e9;
  int threads = 0;
  std::string dtype = "bf16";
  int iters = 5;
  std::string simd = "all";
  bool into = false;
};

int run(const Options& o) {
  DType dtype;
  if (o.dtype == "bf16")
    dtype = DType::BF16;
  else if (o.dtype == "f32")
    dtype = DType::F32;
  else
    return fail(Status::invalid_argument("--dtype must be bf16 or f32, got '" + o.dtype + "'"));
  if (!(o.params >= 1) || o.params > 1e12)
    return fail(Status::invalid_argument("--params must be between 1 and 1e12"));
  if (o.iters < 1) return fail(Status::invalid_argument("--iters must be at least 1"));

  std::vector<SimdLevel> levels;
  for (SimdLevel s : {SimdLevel::Avx512, SimdLevel::Avx2, SimdLevel::Scalar}) {
    bool wanted = o.simd == "all" || o.simd == simd_level_name(s);
    if (wanted && adamw_force_simd_level(s)) levels.push_back(s);
  }
  if (levels.empty())
    return fail(Status::invalid_argument("--simd '" + o.simd + "' is not one of all, avx512, avx2, scalar on this CPU"));

  const size_t n = static_cast<size_t>(o.params);
  const size_t pbytes = dtype_size(dtype);
  if (Status s = start_global_thread_pool(o.threads); !s.is_ok()) return fail(s.with_context("--threads"));
  ThreadPool& pool = global_thread_pool();

  auto t0 = std::chrono::steady_clock::now();
  auto state = HostAdamState::make(n, dtype, o.into);  // sim/profiler.h: allocated and first touched by the pool
  if (!state) return fail(state.status());
  double touch_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // Bytes moved per param: read and write master, m, v; read grad; write param.
  const double bytes_per_param = 24.0 + 2.0 * static_cast<double>(pbytes);
  std::printf("bench adam: %zu params, dtype %s, %d threads, state %s (%.0f B/param moved), %s, touched in %.1f s\n",
              n, dtype_name(dtype), pool.size(), format_size((12 + 2 * pbytes + (o.into ? 12 : 0)) * n).c_str(),
              bytes_per_param, o.into ? "out of place (the speculative update)" : "in place", touch_s);
  std::printf("%-8s %8s %14s %14s %12s\n", "simd", "threads", "Gparams/s", "Gparams/s", "GB/s");
  std::printf("%-8s %8s %14s %14s %12s\n", "", "", "(best)", "(mean)", "(best)");

  int64_t step = 1;
  for (SimdLevel s : levels) {
    adamw_force_simd_level(s);
    state->step(step++);
    double best = 1e30, total = 0;
    for (int it = 0; it < o.iters; ++it) {
      auto a = std::chrono::steady_clock::now();
      state->step(step++);
      double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
      best = std::min(best, sec);
      total += sec;
    }
    double gbest = static_cast<double>(n) / best / 1e9;
    double gmean = static_cast<double>(n) * o.iters / total / 1e9;
    std::printf("%-8s %8d %14.2f %14.2f %12.1f\n", simd_level_name(s), pool.size(), gbest, gmean,
                gbest * bytes_per_param);
    std::fflush(stdout);
  }
  adamw_force_simd_level(levels.front());
  return 0;
}

CommandRegistration reg("bench adam", "host AdamW throughput (G params/s) per SIMD level", [](CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--params", o->params, "number of parameters (1e9 form accepted)")->capture_default_str();
  app.add_option("--threads", o->threads, "threads (0: all hardware threads)")->capture_default_str();
  app.add_option("--dtype", o->dtype, "param and grad dtype: bf16 or f32")->capture_default_str();
  app.add_option("--iters", o->iters, "timed steps per SIMD level")->capture_default_str();
  app.add_option("--simd", o->simd, "all, avx512, avx2 or scalar")->capture_default_str();
  app.add_flag("--into", o->into,
               "out of place: read one master, m and v and write a second (as speculative updates do)");
  return [o]() -> int { return run(*o); };
});

}  // namespace
}  // namespace spillway::cli
