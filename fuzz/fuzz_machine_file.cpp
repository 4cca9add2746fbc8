// libFuzzer target: a machine file (Machine::from_json, sim/machine.h), as `spillway
// profile` writes it and --machine reads it. Properties: an accepted file has every
// rate finite and above 0 (latency and the alone AdamW rate at least 0), a duplex
// factor and compute share in (0, 1], every per-kind op rate finite and 0 (not
// measured) or above, and its to_json() reads back as the same machine.
#include <cmath>
#include <cstdint>
#include <string>

#include "fuzz_support.h"
#include "sim/machine.h"

using namespace spillway;

namespace {
bool positive(double v) { return std::isfinite(v) && v > 0; }
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto m = Machine::from_json(text, "fuzz.json");
  if (!m.ok()) return 0;
  fuzz::require(positive(m->h2d_bytes_per_s) && positive(m->d2h_bytes_per_s) &&
                    positive(m->storage_read_bytes_per_s) && positive(m->storage_write_bytes_per_s) &&
                    positive(m->matmul_flops_per_s) && positive(m->attention_flops_per_s) &&
                    positive(m->device_bytes_per_s) && positive(m->host_adam_params_per_s),
                "an accepted machine has a rate that is not a positive finite number");
  fuzz::require(positive(m->duplex_factor) && m->duplex_factor <= 1 && positive(m->compute_share_while_copying) &&
                    m->compute_share_while_copying <= 1 && positive(m->copy_share_while_computing) &&
                    m->copy_share_while_computing <= 1,
                "an accepted machine has a share outside (0, 1]");
  fuzz::require(std::isfinite(m->op_launch_s) && m->op_launch_s >= 0 && std::isfinite(m->storage_latency_s) &&
                    m->storage_latency_s >= 0 && std::isfinite(m->host_adam_params_per_s_alone) &&
                    m->host_adam_params_per_s_alone >= 0,
                "an accepted machine has a negative or non-finite time or alone rate");
  for (const OpFit& f : m->op_fits)
    for (double r : {f.fixed_s, f.rate, f.bytes_per_s})
      fuzz::require(std::isfinite(r) && r >= 0, "an accepted machine has a negative or non-finite op fit term");
  auto again = Machine::from_json(m->to_json(), "written");
  fuzz::require(again.ok(), "the JSON written for an accepted machine does not read back");
  fuzz::require(*again == *m, "the JSON written for an accepted machine reads back as another machine");
  return 0;
}
