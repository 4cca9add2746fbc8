// Trace: Chrome trace JSON that Perfetto opens — named tracks, slices, counters,
// and clear errors on write.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <unistd.h>

#include "exec/trace.h"
#include "sim/simulator.h"

using namespace spillway;

namespace {

std::set<std::string> thread_names(const nlohmann::json& j) {
  std::set<std::string> names;
  for (const auto& e : j["traceEvents"])
    if (e["ph"] == "M" && e["name"] == "thread_name") names.insert(e["args"]["name"].get<std::string>());
  return names;
}

int tid_of(const nlohmann::json& j, const std::string& track) {
  for (const auto& e : j["traceEvents"])
    if (e["ph"] == "M" && e["name"] == "thread_name" && e["args"]["name"] == track) return e["tid"].get<int>();
  return -1;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("spillway-trace-" + std::to_string(getpid()) + "-" + name)).string();
}

}  // namespace

TEST(Trace, WritesChromeTraceJsonWithTracksAndCounters) {
  Trace trace;
  trace.slice("compute", "mb0.h0.attn.forward", 0.001, 0.0032, {{"op", 17}});
  trace.slice("h2d", "h1.attn.qkv.weight", 0.001, 0.0025, {{"bytes", 7077888}});
  trace.slice("stall", "wait h2d x", 0.0025, 0.003);  // a track beyond the standard ones
  trace.counter("device bytes", 0.001, 3.2e9);
  trace.counter("device bytes", 0.002, 1.6e9);
  EXPECT_EQ(trace.slice_count(), 3u);
  EXPECT_EQ(trace.counter_count(), 2u);

  const std::string path = temp_path("ok.json");
  Status s = trace.write(path);
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::filesystem::remove(path);
  nlohmann::json j = nlohmann::json::parse(text.str());  // throws if not JSON
  ASSERT_TRUE(j["traceEvents"].is_array());

  const auto names = thread_names(j);
  for (const char* t : {"compute", "host", "h2d", "d2h", "storage read", "storage write", "stall"})
    EXPECT_TRUE(names.count(t)) << t;
  EXPECT_LT(tid_of(j, "compute"), tid_of(j, "h2d"));
  EXPECT_LT(tid_of(j, "storage write"), tid_of(j, "stall"));

  int slices = 0, counters = 0;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "X") {
      ++slices;
      if (e["name"] == "mb0.h0.attn.forward") {
        EXPECT_EQ(e["tid"].get<int>(), tid_of(j, "compute"));
        EXPECT_NEAR(e["ts"].get<double>(), 1000.0, 1e-9);   // microseconds
        EXPECT_NEAR(e["dur"].get<double>(), 2200.0, 1e-9);
        EXPECT_EQ(e["args"]["op"], 17);
      }
    } else if (e["ph"] == "C") {
      ++counters;
      EXPECT_EQ(e["name"], "device bytes");
      EXPECT_TRUE(e["args"].contains("value"));
    }
  }
  EXPECT_EQ(slices, 3);
  EXPECT_EQ(counters, 2);
}

TEST(Trace, WriteToAnUnwritablePathNamesTheFile) {
  Trace trace;
  trace.slice("compute", "op", 0, 1);
  const std::string path = "/nonexistent-spillway-dir/sub/trace.json";
  Status s = trace.write(path);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find(path), std::string::npos) << s.to_string();
  // A directory is not a writable file either.
  Status d = trace.write(std::filesystem::temp_directory_path().string());
  ASSERT_FALSE(d.is_ok());
  EXPECT_NE(d.message().find(std::filesystem::temp_directory_path().string()), std::string::npos);
}

TEST(Trace, FromSimulationDrawsEveryEventAndMemoryCounters) {
  Program p;
  TensorId a = p.tensors.add({"a", DType::F32, {1000}, Role::Input});
  TensorId w = p.tensors.add({"w", DType::F32, {1000}, Role::Param});
  TensorId b = p.tensors.add({"b", DType::F32, {1000}, Role::Activation});
  p.add_op({.kind = OpKind::GeluForward, .name = "op0", .operands = {{b, Access::Write}, {a, Access::Read}},
            .attrs = {.n = 1000}});
  p.add_op({.kind = OpKind::GeluForward, .name = "op1", .operands = {{b, Access::Write}, {w, Access::Read}},
            .attrs = {.n = 1000}});
  Plan plan;
  plan.home = {Tier::Device, Tier::Host, Tier::Device};
  plan.home_offset = {0, 0, 0};
  plan.home_host_offset = {0, 0, 4096};
  plan.instructions = {{.kind = InstrKind::Allocate, .tensor = b, .offset = 4096},
                       {.kind = InstrKind::Fetch, .tensor = w, .offset = 8192},
                       {.kind = InstrKind::Run, .op = 0},
                       {.kind = InstrKind::Run, .op = 1},
                       {.kind = InstrKind::HostAllocate, .tensor = b, .offset = 4096},
                       {.kind = InstrKind::Evict, .tensor = b},
                       {.kind = InstrKind::Release, .tensor = w}};
  Machine m;
  m.measured_op_seconds = {1e-3, 1e-3};
  SimResult r = simulate(p, plan, m);
  EXPECT_EQ(r.plan_error, "");
  Trace trace = trace_from_simulation(r);
  EXPECT_EQ(trace.slice_count(), r.timeline.size());
  EXPECT_EQ(trace.counter_count(), 3 * r.memory.size());
  nlohmann::json j = trace.to_json();
  std::set<std::string> counter_names;
  std::set<std::string> used_tracks;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "C") counter_names.insert(e["name"].get<std::string>());
    if (e["ph"] == "X") used_tracks.insert(e["cat"].get<std::string>());
  }
  EXPECT_EQ(counter_names, (std::set<std::string>{"device bytes", "host bytes", "storage bytes"}));
  EXPECT_EQ(used_tracks, (std::set<std::string>{"compute", "h2d", "d2h"}));
  // Round trip through text.
  EXPECT_EQ(nlohmann::json::parse(j.dump()), j);
}
