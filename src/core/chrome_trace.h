// Trace: one training step drawn as a Chrome trace (the "traceEvents" JSON that
// Perfetto and chrome://tracing open).
//
//   Trace trace;
//   trace.slice("compute", "mb0.h0.attn.forward", 0.0010, 0.0032, {{"op", 17}});
//   trace.slice("h2d", "h1.attn.qkv.weight", 0.0010, 0.0025, {{"bytes", 7077888}});
//   trace.counter("device bytes", 0.0010, 3.2e9);
//   if (Status s = trace.write("step.json"); !s.is_ok()) die(s);  // names the file
//
//   trace_from_simulation(simulate(program, plan, machine)).write("predicted.json");  // sim/simulator.h
//
// The executor records its steps into one (exec/trace.h); the simulator draws its
// predicted step into one.
//
// Each track becomes a named thread of one process ("spillway"); the tracks
// compute, host, h2d, d2h, storage read and storage write are always present and
// drawn in that order, other track names follow in order of first use. Each counter
// name becomes a counter track (Perfetto draws it as a graph). Times are seconds
// from the start of the step. Recording is thread-safe.
#pragma once

#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/status.h"

namespace spillway {

class Trace {
 public:
  Trace();
  Trace(Trace&& other) noexcept;
  Trace& operator=(Trace&& other) noexcept;

  // A span of work on a track, [start_s, end_s).
  void slice(std::string track, std::string name, double start_s, double end_s, nlohmann::json args = {});
  // The value of counter `name` from time t_s on.
  void counter(std::string name, double t_s, double value);

  size_t slice_count() const;
  size_t counter_count() const;
  // {"traceEvents": [...], "displayTimeUnit": "ms"}
  nlohmann::json to_json() const;
  // Writes to_json() to `path`; an error names the file and the cause.
  Status write(const std::string& path) const;

 private:
  struct Slice {
    int track;
    std::string name;
    double start_s, end_s;
    nlohmann::json args;
  };
  struct Counter {
    std::string name;
    double t_s;
    double value;
  };
  int track_id(const std::string& track);  // caller holds mu_

  mutable std::mutex mu_;
  std::vector<std::string> tracks_;  // tid = index + 1
  std::map<std::string, int> track_index_;
  std::vector<Slice> slices_;
  std::vector<Counter> counters_;
};

}  // namespace spillway
