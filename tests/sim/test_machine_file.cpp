// Machine files (sim/machine.h): every field round-trips, every malformed file is
// refused with the key and the file named, and the repository's preset files agree
// with the presets in code; attention ops are costed at the attention rate.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "model/model.h"
#include "program/op_registry.h"
#include "sim/machine.h"

namespace spillway {
namespace {

// Every field differs from its default and from the other fields.
Machine every_field_set() {
  Machine m;
  m.name = "test box";
  m.device_bytes = 24ull << 30;
  m.host_bytes = (64ull << 30) + 7;
  m.storage_bytes = (1ull << 40) + 3;
  m.h2d_bytes_per_s = 12.5e9 + 0.25;
  m.d2h_bytes_per_s = 11.75e9;
  m.duplex_factor = 0.8123456789012345;
  m.compute_share_while_copying = 0.66;
  m.copy_share_while_computing = 0.875;
  m.copy_share_while_host_computes = 0.625;
  m.compute_share_while_host_computes = 0.375;
  m.host_share_while_computing = 0.4375;
  m.storage_read_bytes_per_s = 3.3e9;
  m.storage_write_bytes_per_s = 2.9e9;
  m.storage_duplex_factor = 0.6875;
  m.storage_latency_s = 8.5e-5;
  m.matmul_flops_per_s = 1.234e14;
  m.attention_flops_per_s = 2.5e13;
  m.device_bytes_per_s = 9.87e11;
  m.op_launch_s = 3.25e-6;
  m.op_fits[static_cast<size_t>(OpKind::MatmulBackward)] = {.fixed_s = 1.5e-5, .rate = 1.5e11, .bytes_per_s = 1.25e10};
  m.op_fits[static_cast<size_t>(OpKind::GeluForward)] = {.rate = 7.25e9};
  m.op_fits[static_cast<size_t>(OpKind::Zero)] = {.fixed_s = 2e-6};
  m.host_adam_params_per_s = 2.1e9;
  m.host_adam_params_per_s_alone = 2.6e9;
  m.host_adam_out_of_place_share = 0.8125;
  m.host_runs_ahead = false;
  m.measured_op_seconds = {1e-3, 0, 2.5e-4};
  m.measured_on = {.date = "2026-12-04T10:00:00Z", .host = "box", .cpu = "Some CPU, 8 cores",
                   .gpu = "Some GPU, 24 GiB", .driver = "550.1", .notes = "by hand"};
  return m;
}

TEST(MachineFile, EveryFieldRoundTrips) {
  const Machine m = every_field_set();
  auto back = Machine::from_json(m.to_json(), "mem.json");
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(*back, m);
  EXPECT_EQ(back->to_json(), m.to_json());
  // And the defaults differ from it, so the comparison could fail.
  EXPECT_NE(Machine(), m);
}

// The error of reading `j` as file "bad.json"; empty when it was accepted.
std::string error_of(const nlohmann::json& j) {
  auto r = Machine::from_json(j.dump(), "bad.json");
  return r.ok() ? std::string() : r.status().to_string();
}

TEST(MachineFile, EachMissingFieldIsNamed) {
  const nlohmann::json good = nlohmann::json::parse(every_field_set().to_json());
  ASSERT_TRUE(error_of(good).empty());
  int keys = 0;
  for (auto it = good.begin(); it != good.end(); ++it) {
    nlohmann::json j = good;
    j.erase(it.key());
    const std::string e = error_of(j);
    EXPECT_NE(e.find("bad.json"), std::string::npos) << it.key() << ": " << e;
    EXPECT_NE(e.find(it.key()), std::string::npos) << it.key() << ": " << e;
    ++keys;
  }
  EXPECT_EQ(keys, 29);  // format, version, name, measured_on and the 25 other fields
  for (auto it = good["measured_on"].begin(); it != good["measured_on"].end(); ++it) {
    nlohmann::json j = good;
    j["measured_on"].erase(it.key());
    const std::string e = error_of(j);
    EXPECT_NE(e.find("measured_on." + it.key()), std::string::npos) << e;
    EXPECT_NE(e.find("missing"), std::string::npos) << e;
  }
}

// Found by fuzz/fuzz_machine_file.cpp: a number beyond double's range made the JSON
// library throw out_of_range, which ended the process instead of an error.
TEST(MachineFile, NumbersBeyondDoubleAreAnError) {
  for (const std::string& text : {std::string("6.666666666666666666E666Cm"), std::string("{\"h2d_bytes_per_s\": 1e999}")}) {
    const std::string e = [&] {
      auto r = Machine::from_json(text, "big.json");
      return r.ok() ? std::string() : r.status().to_string();
    }();
    EXPECT_NE(e.find("big.json"), std::string::npos) << e;
    EXPECT_NE(e.find("not JSON"), std::string::npos) << e;
  }
}

TEST(MachineFile, WrongTypesUnknownKeysAndBadValuesAreNamed) {
  const nlohmann::json good = nlohmann::json::parse(every_field_set().to_json());
  struct Case {
    std::string key;
    nlohmann::json value;
    std::string says;
  };
  for (const Case& c : std::vector<Case>{{"h2d_bytes_per_s", "fast", "expected a number"},
                                         {"h2d_bytes_per_s", -1.0, "above 0"},
                                         {"storage_read_bytes_per_s", 0, "above 0"},
                                         {"duplex_factor", 1.5, "at most 1"},
                                         {"device_bytes", 2.5, "whole number"},
                                         {"device_bytes", -4, "whole number"},
                                         {"host_runs_ahead", 1, "true or false"},
                                         {"name", 3, "string"},
                                         {"measured_op_seconds", 1.0, "array"},
                                         {"measured_on", "today", "object"},
                                         {"version", 1, "versions 2 to 8"},
                                         {"version", 9, "the file is version 9"},
                                         {"storage_duplex_factor", 0, "above 0"},
                                         {"storage_duplex_factor", 1.25, "at most 1"},
                                         {"host_adam_out_of_place_share", 0, "above 0"},
                                         {"host_adam_out_of_place_share", 1.5, "at most 1"},
                                         {"compute_share_while_host_computes", 1.5, "at most 1"},
                                         {"host_share_while_computing", 0, "above 0"},
                                         {"copy_share_while_computing", 1.5, "at most 1"},
                                         {"copy_share_while_computing", 0, "above 0"},
                                         {"op_fits", 2.0, "expected an object"},
                                         {"op_fits", {{"Gelu", {{"fixed_s", 0}, {"rate", 1e9}, {"bytes_per_s", 0}}}},
                                          "op_fits.Gelu: not a kind of op"},
                                         {"op_fits", {{"GeluForward", 1e9}}, "op_fits.GeluForward: expected an object"},
                                         {"op_fits", {{"GeluForward", {{"fixed_s", 0}, {"rate", 1e9}}}},
                                          "op_fits.GeluForward.bytes_per_s: missing"},
                                         {"op_fits", {{"GeluForward", {{"fixed_s", 0}, {"rate", -1e9}, {"bytes_per_s", 0}}}},
                                          "op_fits.GeluForward.rate: expected a number 0 or more"},
                                         {"op_fits", {{"AdamW", {{"fixed_s", 0}, {"rate", "fast"}, {"bytes_per_s", 0}}}},
                                          "op_fits.AdamW.rate: expected a number"},
                                         {"op_fits", {{"GeluForward", {{"fixed_s", 0}, {"rate", 0}, {"bytes_per_s", 0}}}},
                                          "op_fits.GeluForward: every term is 0"},
                                         {"op_fits", {{"GeluForward", {{"fixed_s", 0}, {"rate", 1e9}, {"bytes_per_s", 1e9}}}},
                                          "op_fits.GeluForward.bytes_per_s: only kinds with flops"},
                                         {"op_fits",
                                          {{"GeluForward", {{"fixed_s", 0}, {"rate", 1e9}, {"bytes_per_s", 0}, {"x", 1}}}},
                                          "op_fits.GeluForward.x: unknown key"},
                                         {"attention_flops_per_s", 0, "above 0"},
                                         {"format", "other", "spillway-machine"}}) {
    nlohmann::json j = good;
    j[c.key] = c.value;
    const std::string e = error_of(j);
    EXPECT_NE(e.find("bad.json"), std::string::npos) << c.key << ": " << e;
    EXPECT_NE(e.find(c.key), std::string::npos) << c.key << ": " << e;
    EXPECT_NE(e.find(c.says), std::string::npos) << c.key << ": " << e;
  }
  nlohmann::json j = good;
  j["h2d_gbps"] = 10;
  std::string e = error_of(j);
  EXPECT_NE(e.find("h2d_gbps: unknown key"), std::string::npos) << e;
  j = good;
  j["measured_on"]["gpu_count"] = 2;
  e = error_of(j);
  EXPECT_NE(e.find("measured_on.gpu_count: unknown key"), std::string::npos) << e;
  j = good;
  j["measured_op_seconds"] = {1e-3, "x"};
  e = error_of(j);
  EXPECT_NE(e.find("measured_op_seconds[1]"), std::string::npos) << e;
  auto not_json = Machine::from_json("{\"format\": ", "bad.json");
  ASSERT_FALSE(not_json.ok());
  EXPECT_NE(not_json.status().to_string().find("bad.json: not JSON"), std::string::npos);
}

// Version 2 files (before op_rates) are still read: every kind is costed by the class
// rates, as they were. A version 2 file with op_rates is refused (an unknown key).
TEST(MachineFile, Version2FilesAreReadWithNoOpFits) {
  nlohmann::json j = nlohmann::json::parse(every_field_set().to_json());
  j["version"] = 2;
  j.erase("op_fits");
  j.erase("copy_share_while_computing");
  j.erase("copy_share_while_host_computes");
  j.erase("compute_share_while_host_computes");
  j.erase("host_share_while_computing");
  j.erase("host_adam_out_of_place_share");
  j.erase("storage_duplex_factor");
  auto m = Machine::from_json(j.dump(), "old.json");
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  Machine want = every_field_set();
  want.op_fits = {};
  want.copy_share_while_computing = 1.0;  // copies at full speed while compute runs, as before
  want.copy_share_while_host_computes = 1.0;
  want.compute_share_while_host_computes = 1.0;
  want.host_share_while_computing = 1.0;
  want.host_adam_out_of_place_share = 1.0;
  want.storage_duplex_factor = 0.5;
  EXPECT_EQ(*m, want);
  for (const OpFit& f : m->op_fits) EXPECT_FALSE(f.measured());
  j["op_rates"] = nlohmann::json::object();
  const std::string e = error_of(j);
  EXPECT_NE(e.find("op_rates: unknown key"), std::string::npos) << e;
  // The fuzz corpus keeps such a file (the cpu preset as version 2 wrote it).
  auto corpus = load_machine(std::string(SPILLWAY_SOURCE_DIR) + "/fuzz/corpus/machine_file/cpu.json");
  ASSERT_TRUE(corpus.ok()) << corpus.status().to_string();
  EXPECT_EQ(corpus->op_fits, (std::array<OpFit, kOpKindCount>{}));
}

// Version 3 files have one rate per kind ("op_rates"): each is read as a fit of that
// rate alone, and copies keep their full speed while compute runs.
TEST(MachineFile, Version3FilesReadEachRateAsAFitOfThatRateAlone) {
  nlohmann::json j = nlohmann::json::parse(every_field_set().to_json());
  j["version"] = 3;
  j.erase("op_fits");
  j.erase("copy_share_while_computing");
  j.erase("copy_share_while_host_computes");
  j.erase("compute_share_while_host_computes");
  j.erase("host_share_while_computing");
  j.erase("host_adam_out_of_place_share");
  j.erase("storage_duplex_factor");
  j["op_rates"] = {{"MatmulBackward", 1.5e11}, {"GeluForward", 7.25e9}};
  auto m = Machine::from_json(j.dump(), "v3.json");
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  Machine want = every_field_set();
  want.op_fits = {};
  want.op_fits[static_cast<size_t>(OpKind::MatmulBackward)] = {.rate = 1.5e11};
  want.op_fits[static_cast<size_t>(OpKind::GeluForward)] = {.rate = 7.25e9};
  want.copy_share_while_computing = 1.0;
  want.copy_share_while_host_computes = 1.0;
  want.compute_share_while_host_computes = 1.0;
  want.host_share_while_computing = 1.0;
  want.host_adam_out_of_place_share = 1.0;
  want.storage_duplex_factor = 0.5;
  EXPECT_EQ(*m, want);
  j["op_rates"] = {{"GeluForward", 0}};
  std::string e = error_of(j);
  EXPECT_NE(e.find("op_rates.GeluForward: expected a number above 0"), std::string::npos) << e;
  j["op_rates"] = {{"GeluForward", 1e9}};
  j["copy_share_while_computing"] = 0.5;  // a version 4 field in a version 3 file
  e = error_of(j);
  EXPECT_NE(e.find("copy_share_while_computing: unknown key"), std::string::npos) << e;
  // The fuzz corpus keeps one (the cpu preset as version 3 wrote it).
  auto corpus = load_machine(std::string(SPILLWAY_SOURCE_DIR) + "/fuzz/corpus/machine_file/cpu_v3.json");
  ASSERT_TRUE(corpus.ok()) << corpus.status().to_string();
  EXPECT_EQ(corpus->op_fit(OpKind::MatmulForward).fixed_s, 0);
  EXPECT_GT(corpus->op_fit(OpKind::MatmulForward).rate, 0);
}

// Version 4 files have no copy_share_while_host_computes: copies keep their full speed
// while a host op runs, as version 4 modelled; the key in a version 4 file is refused.
TEST(MachineFile, Version4FilesKeepCopiesAtFullSpeedBesideHostOps) {
  nlohmann::json j = nlohmann::json::parse(every_field_set().to_json());
  j["version"] = 4;
  j.erase("copy_share_while_host_computes");
  j.erase("compute_share_while_host_computes");
  j.erase("host_share_while_computing");
  j.erase("host_adam_out_of_place_share");
  j.erase("storage_duplex_factor");
  auto m = Machine::from_json(j.dump(), "v4.json");
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  Machine want = every_field_set();
  want.copy_share_while_host_computes = 1.0;
  want.compute_share_while_host_computes = 1.0;
  want.host_share_while_computing = 1.0;
  want.host_adam_out_of_place_share = 1.0;
  want.storage_duplex_factor = 0.5;
  EXPECT_EQ(*m, want);
  j["copy_share_while_host_computes"] = 0.5;
  const std::string e = error_of(j);
  EXPECT_NE(e.find("copy_share_while_host_computes: unknown key"), std::string::npos) << e;
  auto corpus = load_machine(std::string(SPILLWAY_SOURCE_DIR) + "/fuzz/corpus/machine_file/cpu_v4.json");
  ASSERT_TRUE(corpus.ok()) << corpus.status().to_string();
  EXPECT_EQ(corpus->copy_share_while_host_computes, 1.0);
  // Above 1 is refused in a version 5 file.
  j["version"] = 5;
  j["copy_share_while_host_computes"] = 1.5;
  EXPECT_NE(error_of(j).find("copy_share_while_host_computes"), std::string::npos);
}

// Version 5 files ran device compute and host ops side by side at full speed.
TEST(MachineFile, Version5FilesKeepComputeAndHostOpsAtFullSpeedSideBySide) {
  nlohmann::json j = nlohmann::json::parse(every_field_set().to_json());
  j["version"] = 5;
  j.erase("compute_share_while_host_computes");
  j.erase("host_share_while_computing");
  j.erase("host_adam_out_of_place_share");
  j.erase("storage_duplex_factor");
  auto m = Machine::from_json(j.dump(), "v5.json");
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  Machine want = every_field_set();
  want.compute_share_while_host_computes = 1.0;
  want.host_share_while_computing = 1.0;
  want.host_adam_out_of_place_share = 1.0;
  want.storage_duplex_factor = 0.5;
  EXPECT_EQ(*m, want);
  j["host_share_while_computing"] = 0.5;
  EXPECT_NE(error_of(j).find("host_share_while_computing: unknown key"), std::string::npos) << error_of(j);
  // In a version 6 file both are required, above 0 and at most 1.
  j["version"] = 6;
  j["compute_share_while_host_computes"] = 0.5;
  ASSERT_TRUE(Machine::from_json(j.dump(), "v6.json").ok());
  j["compute_share_while_host_computes"] = 1.5;
  EXPECT_NE(error_of(j).find("compute_share_while_host_computes"), std::string::npos);
  j["compute_share_while_host_computes"] = 0;
  EXPECT_NE(error_of(j).find("compute_share_while_host_computes"), std::string::npos);
  j.erase("compute_share_while_host_computes");
  EXPECT_NE(error_of(j).find("compute_share_while_host_computes"), std::string::npos);
}

// Version 6 files ran speculative (out-of-place) host updates at the in-place rate.
TEST(MachineFile, Version6FilesRunSpeculativeUpdatesAtTheInPlaceRate) {
  nlohmann::json j = nlohmann::json::parse(every_field_set().to_json());
  j["version"] = 6;
  j.erase("host_adam_out_of_place_share");
  j.erase("storage_duplex_factor");
  auto m = Machine::from_json(j.dump(), "v6.json");
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  Machine want = every_field_set();
  want.host_adam_out_of_place_share = 1.0;
  want.storage_duplex_factor = 0.5;
  EXPECT_EQ(*m, want);
  j["host_adam_out_of_place_share"] = 0.5;
  EXPECT_NE(error_of(j).find("host_adam_out_of_place_share: unknown key"), std::string::npos) << error_of(j);
  // Required in a version 7 file.
  j["version"] = 7;
  ASSERT_TRUE(Machine::from_json(j.dump(), "v7.json").ok());
  j.erase("host_adam_out_of_place_share");
  j.erase("storage_duplex_factor");
  EXPECT_NE(error_of(j).find("host_adam_out_of_place_share"), std::string::npos) << error_of(j);
}

// Version 7 files timed storage reads and writes as one queue: they read as a duplex
// factor of 0.5, which predicts the same times for reads and writes of equal rates.
TEST(MachineFile, Version7FilesShareTheDriveAsOneQueue) {
  nlohmann::json j = nlohmann::json::parse(every_field_set().to_json());
  j["version"] = 7;
  j.erase("storage_duplex_factor");
  auto m = Machine::from_json(j.dump(), "v7.json");
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  Machine want = every_field_set();
  want.storage_duplex_factor = 0.5;
  EXPECT_EQ(*m, want);
  j["storage_duplex_factor"] = 0.75;
  EXPECT_NE(error_of(j).find("storage_duplex_factor: unknown key"), std::string::npos) << error_of(j);
  // Required in a version 8 file.
  j["version"] = 8;
  ASSERT_TRUE(Machine::from_json(j.dump(), "v8.json").ok());
  j.erase("storage_duplex_factor");
  EXPECT_NE(error_of(j).find("storage_duplex_factor"), std::string::npos) << error_of(j);
}

// The op kinds are written by name, only the measured ones, each with its three terms.
TEST(MachineFile, OpFitsAreWrittenByKindName) {
  const nlohmann::json j = nlohmann::json::parse(every_field_set().to_json());
  EXPECT_EQ(j["version"], 8);
  EXPECT_EQ(j["op_fits"], (nlohmann::json{{"Zero", {{"fixed_s", 2e-6}, {"rate", 0.0}, {"bytes_per_s", 0.0}}},
                                          {"MatmulBackward", {{"fixed_s", 1.5e-5}, {"rate", 1.5e11}, {"bytes_per_s", 1.25e10}}},
                                          {"GeluForward", {{"fixed_s", 0.0}, {"rate", 7.25e9}, {"bytes_per_s", 0.0}}}}));
  EXPECT_EQ(nlohmann::json::parse(Machine().to_json())["op_fits"], nlohmann::json::object());
}

TEST(MachineFile, RepositoryPresetFilesAreThePresetsInCode) {
  for (auto [file, preset] : {std::pair{"h200.json", Machine::h200()}, std::pair{"cpu.json", Machine::cpu_dev_box()}}) {
    const std::string path = std::string(SPILLWAY_SOURCE_DIR) + "/machines/" + file;
    auto m = load_machine(path);
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    EXPECT_EQ(*m, preset) << "machines/" << file << " and the preset in code differ:\n"
                          << m->to_json() << "\n" << preset.to_json();
    EXPECT_FALSE(m->measured_on.date.empty());
  }
}

TEST(MachineFile, PresetsByNameAndMissingFiles) {
  auto h = load_machine("h200");
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(*h, Machine::h200());
  auto c = load_machine("cpu");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c, Machine::cpu_dev_box());
  auto missing = load_machine("/nonexistent/box.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().to_string().find("/nonexistent/box.json"), std::string::npos);
}

TEST(MachineFile, SaveThenLoad) {
  const std::string path = ::testing::TempDir() + "/spillway-machine-save.json";
  const Machine m = every_field_set();
  ASSERT_TRUE(save_machine(m, path).is_ok());
  auto back = load_machine(path);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(*back, m);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace spillway

// The driver version of a machine's identity (the cache key of a measured machine),
// from both forms of /proc/driver/nvidia/version's first line.
TEST(MachineIdentity, DriverVersionFromEitherKernelModuleLine) {
  using spillway::nvidia_driver_version_from;
  EXPECT_EQ(nvidia_driver_version_from("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 "
                                       "19:44:05 UTC 2024"),
            "550.54.15");
  // The open kernel module says "for x86_64" before the version (read as "for" once).
  EXPECT_EQ(nvidia_driver_version_from("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release "
                                       "Build  (dvs-builder@U16-I3-B03-4-3)  Tue Sep 23 09:40:46 UTC 2025"),
            "580.95.05");
  EXPECT_EQ(nvidia_driver_version_from(""), "unknown");
  EXPECT_EQ(nvidia_driver_version_from("NVRM version: something else 1.x"), "unknown");
}

// MFU's denominator: the data sheet's dense bf16 peak, by the names CUDA reports (the
// backend's description starts with the name), and none for a GPU not in the table.
TEST(MachineIdentity, DataSheetPeakByCudaDeviceName) {
  using spillway::data_sheet_bf16_peak;
  EXPECT_DOUBLE_EQ(data_sheet_bf16_peak("NVIDIA H100 80GB HBM3, 79.18 GiB (device 0)").flops_per_s, 989.4e12);
  EXPECT_EQ(data_sheet_bf16_peak("NVIDIA H100 80GB HBM3").part, "H100 SXM");
  EXPECT_DOUBLE_EQ(data_sheet_bf16_peak("NVIDIA H100 PCIe").flops_per_s, 756e12);
  EXPECT_DOUBLE_EQ(data_sheet_bf16_peak("NVIDIA H100 NVL").flops_per_s, 835e12);
  EXPECT_DOUBLE_EQ(data_sheet_bf16_peak("NVIDIA H200, 139.8 GiB").flops_per_s, 989e12);
  EXPECT_EQ(data_sheet_bf16_peak("NVIDIA H200").part, "H200 SXM");
  EXPECT_DOUBLE_EQ(data_sheet_bf16_peak("NVIDIA H200 NVL").flops_per_s, 835e12);
  EXPECT_EQ(data_sheet_bf16_peak("NVIDIA GH200 480GB").part, "GH200");
  EXPECT_DOUBLE_EQ(data_sheet_bf16_peak("NVIDIA A100-SXM4-80GB").flops_per_s, 312e12);
  // Unknown parts, and names that only contain a known one inside a word, get none.
  EXPECT_EQ(data_sheet_bf16_peak("NVIDIA GeForce RTX 4090").flops_per_s, 0);
  EXPECT_EQ(data_sheet_bf16_peak("XH1000 accelerator").flops_per_s, 0);
  EXPECT_EQ(data_sheet_bf16_peak("CPU, 2 threads").flops_per_s, 0);
  EXPECT_EQ(data_sheet_bf16_peak("").part, "");
}

// Attention ops are timed at the attention rate, matrix products at the matmul rate.
TEST(MachineCost, AttentionOpsUseTheAttentionRate) {
  using namespace spillway;
  auto program = build_training_program(ModelConfig{2, 256, 4, 512, 256}, StepShape{4, 512, 1}, DType::BF16);
  ASSERT_TRUE(program.ok()) << program.status().to_string();
  Machine m = Machine::h200();
  m.op_launch_s = 0;
  size_t attention = SIZE_MAX, matmul = SIZE_MAX;
  for (size_t i = 0; i < program->ops.size(); ++i) {
    const OpClass c = op_info(program->ops[i].kind).op_class;
    if (c == OpClass::Attention && attention == SIZE_MAX) attention = i;
    if (c == OpClass::Matmul && matmul == SIZE_MAX) matmul = i;
  }
  ASSERT_NE(attention, SIZE_MAX);
  ASSERT_NE(matmul, SIZE_MAX);
  m.attention_flops_per_s = 1e12;  // slow enough that the op is compute-bound
  const double slow = m.op_seconds(*program, attention);
  const double product = m.op_seconds(*program, matmul);
  EXPECT_DOUBLE_EQ(slow, op_cost_flops(program->ops[attention]) / 1e12);
  m.attention_flops_per_s = 2e12;
  EXPECT_DOUBLE_EQ(m.op_seconds(*program, attention), slow / 2);
  EXPECT_DOUBLE_EQ(m.op_seconds(*program, matmul), product);
}
