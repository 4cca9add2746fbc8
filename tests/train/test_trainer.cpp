// Trainer, schedule, metrics, checkpoints and sampling on the CPU backend.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/hf_model.h"
#include "train/data.h"
#include "train/sampler.h"
#include "train/schedule.h"
#include "train/trainer.h"
#include "support/fault_support.h"
#include "support/trainer_support.h"
#include "support/test_support.h"

namespace spillway {
namespace {

std::unique_ptr<Backend> cpu_backend() {
  auto b = make_backend("cpu", {.threads = 2});
  EXPECT_TRUE(b.ok()) << b.status().to_string();
  return std::move(*b);
}

ModelConfig micro_config() { return {.layers = 2, .width = 32, .heads = 2, .context = 8, .vocab = 256}; }

TrainerOptions micro_options() {
  TrainerOptions o;
  o.model = micro_config();
  o.shape = {.B = 2, .T = 8, .accum = 2};
  o.schedule = {.peak = 1e-2f, .warmup_steps = 2, .total_steps = 6};
  o.seed = 7;
  o.machine = Machine::cpu_dev_box();
  return o;
}

std::vector<TokenBatch> random_batches(int accum, int B, int T, uint64_t seed) {
  std::vector<TokenBatch> out(static_cast<size_t>(accum));
  uint64_t s = seed;
  auto next = [&] {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<int32_t>((s >> 33) % 256);
  };
  for (TokenBatch& b : out) {
    for (int i = 0; i < B * T; ++i) {
      b.tokens.push_back(next());
      b.targets.push_back(next());
    }
  }
  return out;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("spillway_test_trainer_" + name)).string();
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// The steps' results; with `state`, also every tensor of the state after them.
std::vector<StepResult> run_steps(Backend& backend, const TrainerOptions& o, int steps,
                                  std::map<std::string, std::vector<float>>* state = nullptr) {
  auto t = Trainer::create(backend, o);
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  if (!t.ok()) return {};
  EXPECT_TRUE((*t)->init_parameters().is_ok());
  std::vector<StepResult> out;
  for (int s = 0; s < steps; ++s) {
    auto r = (*t)->step(random_batches(o.shape.accum, o.shape.B, o.shape.T, 100 + s));
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    if (!r.ok()) break;
    out.push_back(*r);
  }
  if (state) *state = testing_support::read_state(**t);
  return out;
}

TEST(LrSchedule, WarmupThenCosineToTenPercent) {
  LrSchedule s{.peak = 1e-3f, .warmup_steps = 10, .total_steps = 110};
  const double peak = 1e-3f;  // the float peak, widened: the schedule computes in double
  EXPECT_EQ(s.at(1), static_cast<float>(peak * 1 / 10));
  EXPECT_EQ(s.at(5), static_cast<float>(peak * 5 / 10));
  EXPECT_EQ(s.at(10), 1e-3f);
  // Halfway through the decay: min + (peak - min) / 2 = 0.55 * peak.
  EXPECT_FLOAT_EQ(s.at(60), 0.55e-3f);
  EXPECT_FLOAT_EQ(s.at(110), 1e-4f);
  EXPECT_FLOAT_EQ(s.at(500), 1e-4f);
  for (int64_t i = 11; i < 110; ++i) EXPECT_LE(s.at(i + 1), s.at(i)) << "step " << i;
  LrSchedule flat{.peak = 2e-3f, .warmup_steps = 0, .total_steps = 1};
  EXPECT_FLOAT_EQ(flat.at(1), 2e-4f);  // the only step is the last: the minimum
  LrSchedule all_warmup{.peak = 2e-3f, .warmup_steps = 5, .total_steps = 5};
  EXPECT_EQ(all_warmup.at(5), 2e-3f);
  EXPECT_EQ(all_warmup.at(7), 2e-3f);
}

TEST(Trainer, SameSeedGivesIdenticalLosses) {
  auto backend = cpu_backend();
  TrainerOptions o = micro_options();
  auto a = run_steps(*backend, o, 5);
  auto b = run_steps(*backend, o, 5);
  ASSERT_EQ(a.size(), 5u);
  ASSERT_EQ(b.size(), 5u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(bits(a[i].loss), bits(b[i].loss)) << "step " << i + 1;
    EXPECT_EQ(bits(a[i].grad_norm), bits(b[i].grad_norm)) << "step " << i + 1;
    EXPECT_EQ(a[i].lr, o.schedule.at(static_cast<int64_t>(i + 1)));
    EXPECT_EQ(a[i].tokens, 2 * 8 * 2);
  }
  // A different seed gives different initial values, hence a different loss.
  o.seed = 8;
  auto c = run_steps(*backend, o, 1);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_NE(bits(c[0].loss), bits(a[0].loss));
}

TEST(Trainer, SpillingBudgetGivesIdenticalLosses) {
  auto backend = cpu_backend();
  TrainerOptions o = micro_options();
  auto resident = run_steps(*backend, o, 4);
  auto t = Trainer::create(*backend, o);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  const uint64_t full = (*t)->plan().device_bytes;
  o.planner.policy = Policy::Planned;
  o.budgets.device = full / 2;
  auto spilled = run_steps(*backend, o, 4);
  ASSERT_EQ(resident.size(), 4u);
  ASSERT_EQ(spilled.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(bits(resident[i].loss), bits(spilled[i].loss)) << "step " << i + 1;
    EXPECT_LE(spilled[i].exec.peak_device_bytes, o.budgets.device);
  }
  // The budget spills: state crosses the link. Counted over the run, since a fetch that
  // waits for the host AdamW is issued (and counted) in whichever step the executor
  // reaches it, often the next one.
  uint64_t h2d = 0;
  for (const StepResult& r : spilled) h2d += r.exec.h2d_bytes;
  EXPECT_GT(h2d, 0u);
}

// Policy auto times its two best-predicted plans for one step each before the run,
// reports both figures, keeps the faster, and the run still gives the resident bits.
TEST(Trainer, AutoTimesItsBestTwoCandidatesAndStaysExact) {
  auto backend = cpu_backend();
  TrainerOptions o = micro_options();
  std::map<std::string, std::vector<float>> resident_state, spilled_state;
  auto resident = run_steps(*backend, o, 3, &resident_state);
  auto t = Trainer::create(*backend, o);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  const uint64_t full = (*t)->plan().device_bytes;
  t->reset();
  o.planner.policy = Policy::Auto;
  o.budgets.device = full / 2;
  o.auto_confirm = 2;
  auto timed = Trainer::create(*backend, o);
  ASSERT_TRUE(timed.ok()) << timed.status().to_string();
  const std::string& d = (*timed)->plan().description;
  EXPECT_NE(d.find("timed one step each: candidate 1 predicted"), std::string::npos) << d;
  EXPECT_NE(d.find(", candidate 2 predicted"), std::string::npos) << d;
  EXPECT_NE(d.find("; kept candidate "), std::string::npos) << d;
  EXPECT_NE(d.find(" s (trial "), std::string::npos) << d;  // each trial's whole time
  EXPECT_NE(d.find("; search "), std::string::npos) << d;   // the one search's
  EXPECT_GT((*timed)->plan().predicted_step_s, 0.0);
  // One pinning for the trials and the run: the run's arena lies in the region of the
  // largest candidate's arena, kept even where the chosen plan needs less.
  {
    auto candidates = auto_plans_for_backend((*timed)->program(), *backend, o.machine, o.budgets, o.planner, 2);
    ASSERT_TRUE(candidates.ok()) << candidates.status().to_string();
    uint64_t most = 0;
    for (const Plan& c : *candidates) most = std::max(most, c.host_arena_bytes());
    EXPECT_EQ((*timed)->host_region_bytes(), most);
    EXPECT_GE((*timed)->host_region_bytes(), (*timed)->plan().host_arena_bytes());
    if ((*timed)->plan().host_arena_bytes() < most) {
      EXPECT_NE(d.find("; the run keeps the trials' pinned host region of "), std::string::npos) << d;
    }
  }
  timed->reset();
  auto spilled = run_steps(*backend, o, 3, &spilled_state);
  ASSERT_EQ(spilled.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(bits(resident[i].loss), bits(spilled[i].loss)) << "step " << i + 1;
  EXPECT_EQ(resident_state, spilled_state);  // every weight, master weight and moment as in the resident run
  // Untimed (0): the simulator's best, and no timing report.
  o.auto_confirm = 0;
  auto untimed = Trainer::create(*backend, o);
  ASSERT_TRUE(untimed.ok()) << untimed.status().to_string();
  EXPECT_EQ((*untimed)->plan().description.find("timed"), std::string::npos) << (*untimed)->plan().description;
  EXPECT_EQ((*untimed)->host_region_bytes(), (*untimed)->plan().host_arena_bytes());
  EXPECT_NE((*untimed)->plan().description.find("candidate 1 of "), std::string::npos);
}

TEST(Trainer, LossIsTheMeanOfEveryTokensLoss) {
  auto backend = cpu_backend();
  TrainerOptions o = micro_options();
  o.schedule.peak = 0;
  auto t = Trainer::create(*backend, o);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  ASSERT_TRUE((*t)->init_parameters().is_ok());
  auto r = (*t)->step(random_batches(2, 2, 8, 1));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  // Untrained GPT-2 init: every token about equally likely, loss near ln(256).
  EXPECT_NEAR(r->loss, std::log(256.0), 0.1);
  EXPECT_EQ(r->loss, static_cast<float>(r->loss_f64));
  EXPECT_GT(r->grad_norm, 0.0f);
  EXPECT_EQ(r->step, 1);
  EXPECT_EQ((*t)->steps_done(), 1);
  // Wrong batch shapes are errors that say what was expected.
  auto bad = (*t)->step(random_batches(1, 2, 8, 1));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("takes 2 micro-batches"), std::string::npos) << bad.status().message();
}

// The gradient the executor leaves in grad.<p> against central finite differences
// of the step's loss, for the entries with the largest gradients of several
// parameters. lr = 0 keeps the parameters fixed across the probing steps.
TEST(Trainer, GradientMatchesFiniteDifferences) {
  auto backend = cpu_backend();
  TrainerOptions o = micro_options();
  o.schedule = {.peak = 0, .warmup_steps = 0, .total_steps = 1};
  auto t = Trainer::create(*backend, o);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  Trainer& tr = **t;
  ASSERT_TRUE(tr.init_parameters().is_ok());
  const auto batches = random_batches(2, 2, 8, 42);
  auto base = tr.step(batches);
  ASSERT_TRUE(base.ok()) << base.status().to_string();

  const std::vector<std::string> names = {
      "transformer.wte.weight",           "transformer.wpe.weight",
      "transformer.h.0.ln_1.weight",      "transformer.h.0.attn.c_attn.weight",
      "transformer.h.0.attn.c_attn.bias", "transformer.h.1.attn.c_proj.weight",
      "transformer.h.1.mlp.c_fc.weight",  "transformer.h.1.mlp.c_proj.bias",
      "transformer.ln_f.bias"};
  const double eps = 1e-2;
  int checked = 0;
  for (const std::string& name : names) {
    auto grad = tr.read_floats("grad." + name);
    auto value = tr.read_floats(name);
    ASSERT_TRUE(grad.ok()) << grad.status().to_string();
    ASSERT_TRUE(value.ok()) << value.status().to_string();
    std::vector<size_t> order(grad->size());
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + 2, order.end(),
                      [&](size_t a, size_t b) { return std::fabs((*grad)[a]) > std::fabs((*grad)[b]); });
    for (int k = 0; k < 2; ++k) {
      const size_t j = order[static_cast<size_t>(k)];
      double loss[2];
      for (int side = 0; side < 2; ++side) {
        std::vector<float> v = *value;
        v[j] = static_cast<float>(static_cast<double>(v[j]) + (side == 0 ? eps : -eps));
        ASSERT_TRUE(tr.write_parameter(name, v).is_ok());
        auto r = tr.step(batches);
        ASSERT_TRUE(r.ok()) << r.status().to_string();
        loss[side] = r->loss_f64;
      }
      ASSERT_TRUE(tr.write_parameter(name, *value).is_ok());
      const double fd = (loss[0] - loss[1]) / (2 * eps);
      const double g = (*grad)[j];
      EXPECT_NEAR(fd, g, 2e-2 * std::fabs(g) + 1e-4) << name << "[" << j << "]";
      ++checked;
    }
  }
  EXPECT_EQ(checked, 18);
  // The restored parameters give the first loss again, bit for bit.
  auto again = tr.step(batches);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(bits(again->loss), bits(base->loss));
}

TEST(Trainer, MetricsLineHasEveryKeyAndRoundTripsTheLoss) {
  StepResult r;
  r.step = 3;
  r.loss = 2.34567891f;
  r.lr = 1e-3f;
  r.grad_norm = 0.5f;
  r.tokens = 1024;
  r.step_s = 0.25;
  r.tokens_per_s = 4096;
  r.exec.h2d_bytes = 11;
  r.exec.peak_device_bytes = 12345;
  auto j = nlohmann::json::parse(metrics_json(r));
  for (const char* key : {"step", "loss", "lr", "grad_norm", "tokens", "step_s", "tokens_per_s", "h2d_bytes",
                          "d2h_bytes", "storage_read_bytes", "storage_write_bytes", "recomputed_ops", "stall_s",
                          "peak_device_bytes", "peak_host_bytes", "peak_storage_bytes"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_FALSE(j.contains("val_loss"));
  EXPECT_EQ(static_cast<float>(j["loss"].get<double>()), r.loss);
  EXPECT_EQ(j["h2d_bytes"].get<uint64_t>(), 11u);
  r.val_loss = 2.5f;
  j = nlohmann::json::parse(metrics_json(r));
  EXPECT_EQ(static_cast<float>(j["val_loss"].get<double>()), 2.5f);
}

// JSON has no NaN or infinity: a diverged step's metrics line still parses, with
// null for every non-finite number, and says the update was skipped.
TEST(Trainer, MetricsLineIsJsonWithNonFiniteNumbers) {
  StepResult r;
  r.step = 7;
  r.loss = std::numeric_limits<float>::quiet_NaN();
  r.grad_norm = std::numeric_limits<float>::infinity();
  r.lr = 1e30f;
  r.step_s = std::numeric_limits<double>::quiet_NaN();
  r.tokens_per_s = -std::numeric_limits<double>::infinity();
  r.val_loss = -std::numeric_limits<float>::infinity();
  r.applied = false;
  const std::string line = metrics_json(r);
  nlohmann::json j;
  ASSERT_NO_THROW(j = nlohmann::json::parse(line)) << line;
  for (const char* key : {"loss", "grad_norm", "step_s", "tokens_per_s", "val_loss"})
    EXPECT_TRUE(j[key].is_null()) << key << " in " << line;
  EXPECT_EQ(static_cast<float>(j["lr"].get<double>()), 1e30f);
  EXPECT_EQ(j["step"].get<int>(), 7);
  EXPECT_TRUE(j["skipped"].get<bool>());
  r.applied = true;
  EXPECT_FALSE(nlohmann::json::parse(metrics_json(r)).contains("skipped"));
}

using testing_support::read_state;

// Bit for bit (NaN included: a NaN written in stays that NaN).
void expect_same_state(const std::map<std::string, std::vector<float>>& got,
                       const std::map<std::string, std::vector<float>>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, values] : want) {
    const std::vector<float>& g = got.at(name);
    ASSERT_EQ(g.size(), values.size()) << what << " " << name;
    for (size_t i = 0; i < g.size(); ++i)
      ASSERT_EQ(bits(g[i]), bits(values[i])) << what << ": " << name << "[" << i << "] " << g[i] << " vs " << values[i];
  }
}

// A NaN in a parameter makes the gradient norm NaN: the step is refused with an error
// naming it, and no parameter, master weight or moment changes, under the resident
// plan (AdamW on the device) and under a spilling one (AdamW on the host). With the
// parameter restored, the next step gives the bits of a run that never failed.
TEST(Trainer, NonFiniteGradientNormStopsTheStepAndKeepsTheState) {
  auto backend = cpu_backend();
  const TrainerOptions base = micro_options();
  const auto reference = run_steps(*backend, base, 3);
  ASSERT_EQ(reference.size(), 3u);
  uint64_t full = 0;
  {
    auto t = Trainer::create(*backend, base);
    ASSERT_TRUE(t.ok());
    full = (*t)->plan().device_bytes;
  }
  for (bool spill : {false, true}) {
    SCOPED_TRACE(spill ? "planned, half the device budget" : "resident");
    TrainerOptions o = base;
    if (spill) {
      o.planner.policy = Policy::Planned;
      o.budgets.device = full / 2;
    }
    auto t = Trainer::create(*backend, o);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    Trainer& tr = **t;
    ASSERT_TRUE(tr.init_parameters().is_ok());
    for (int s = 0; s < 2; ++s) ASSERT_TRUE(tr.step(random_batches(2, 2, 8, 100 + s)).ok());

    const ParamSpec victim = parameter_specs(o.model).back();
    auto good = tr.read_floats("master." + victim.name);
    ASSERT_TRUE(good.ok());
    std::vector<float> poisoned = *good;
    poisoned[0] = std::numeric_limits<float>::quiet_NaN();
    ASSERT_TRUE(tr.write_parameter(victim.name, poisoned).is_ok());
    const auto before = read_state(tr);

    auto r = tr.step(random_batches(2, 2, 8, 102));
    ASSERT_FALSE(r.ok());
    const std::string m = r.status().message();
    for (const char* needle : {"step 3", "gradient norm is nan", "not applied", "those after step 2"})
      EXPECT_NE(m.find(needle), std::string::npos) << "'" << needle << "' not in: " << m;
    EXPECT_EQ(tr.steps_done(), 2);
    ASSERT_TRUE(tr.rejected_step().has_value());
    EXPECT_EQ(tr.rejected_step()->step, 3);
    EXPECT_FALSE(tr.rejected_step()->applied);
    EXPECT_TRUE(std::isnan(tr.rejected_step()->grad_norm));
    EXPECT_TRUE(tr.state_status().is_ok()) << tr.state_status().to_string();
    expect_same_state(read_state(tr), before, "after the skipped step");

    // The state is whole: with the parameter restored, step 3 is the reference's step 3.
    ASSERT_TRUE(tr.write_parameter(victim.name, *good).is_ok());
    auto again = tr.step(random_batches(2, 2, 8, 102));
    ASSERT_TRUE(again.ok()) << again.status().to_string();
    EXPECT_EQ(again->step, 3);
    EXPECT_TRUE(again->applied);
    EXPECT_EQ(bits(again->loss), bits(reference[2].loss));
    EXPECT_EQ(bits(again->grad_norm), bits(reference[2].grad_norm));
    EXPECT_FALSE(tr.rejected_step().has_value());
  }
}

// save() never writes weights that are not finite.
TEST(Trainer, SaveRefusesNonFiniteWeights) {
  auto backend = cpu_backend();
  TrainerOptions o = micro_options();
  auto t = Trainer::create(*backend, o);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->init_parameters().is_ok());
  const ParamSpec p = parameter_specs(o.model)[1];
  auto v = (*t)->read_floats(p.name);
  ASSERT_TRUE(v.ok());
  (*v)[5] = -std::numeric_limits<float>::infinity();
  ASSERT_TRUE((*t)->write_parameter(p.name, *v).is_ok());
  const std::string path = temp_path("nonfinite.safetensors");
  std::filesystem::remove(path);
  Status s = (*t)->save(path);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find(p.name), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("-inf"), std::string::npos) << s.message();
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

// A step that fails inside the executor (injected storage faults) may leave the state
// half-updated: from then on the trainer refuses to read, save, evaluate or train it,
// with the step's error, and save() writes no file. A step refused before it starts
// (wrong micro-batches) changes nothing and refuses nothing.
TEST(Trainer, AfterAFailedStepTheStateIsNeitherReadNorSaved) {
  auto backend = cpu_backend();
  const TrainerOptions base = micro_options();
  uint64_t full = 0;
  {
    auto t = Trainer::create(*backend, base);
    ASSERT_TRUE(t.ok());
    full = (*t)->plan().device_bytes;
    ASSERT_TRUE((*t)->init_parameters().is_ok());
    auto wrong = (*t)->step(random_batches(1, 2, 8, 1));  // accum is 2
    ASSERT_FALSE(wrong.ok());
    EXPECT_TRUE((*t)->state_status().is_ok());
    EXPECT_TRUE((*t)->read_floats("master.transformer.wpe.weight").ok());
  }
  testing_support::TempDir dir;
  int failed_steps = 0;
  for (uint64_t seed = 1; seed <= 40 && failed_steps < 3; ++seed) {
    TrainerOptions o = base;
    o.planner.policy = Policy::Planned;
    o.budgets.device = full / 4;
    o.budgets.host = 512 * 1024;  // master weights and moments go to storage
    o.budgets.storage = 64 << 20;
    o.spill_dir = dir.path();
    o.storage_engine_maker = faulty_storage_engines(seed, 0.004);
    auto t = Trainer::create(*backend, o);
    if (!t.ok()) continue;  // a fault while creating the spill files: not this test's case
    Trainer& tr = **t;
    if (!tr.init_parameters().is_ok()) continue;  // nor one before any step
    Status failure;
    int64_t done = 0;
    for (int s = 0; s < 10 && failure.is_ok(); ++s) {
      auto r = tr.step(random_batches(2, 2, 8, 100 + s));
      if (r.ok()) ++done;
      else failure = r.status();
    }
    if (failure.is_ok()) continue;
    ++failed_steps;
    SCOPED_TRACE("seed " + std::to_string(seed) + ": " + failure.to_string());
    const std::string step_name = "step " + std::to_string(done + 1);
    EXPECT_EQ(failure.message().rfind(step_name + ":", 0), 0u) << failure.message();
    EXPECT_FALSE(tr.state_status().is_ok());
    EXPECT_FALSE(tr.rejected_step().has_value());

    const std::string path = dir.file("after-failure.safetensors");
    Status saved = tr.save(path);
    ASSERT_FALSE(saved.is_ok());
    EXPECT_EQ(saved.code(), failure.code());
    for (const std::string& needle : {std::string("cannot save"), step_name + " failed", std::string("half-updated")})
      EXPECT_NE(saved.message().find(needle), std::string::npos) << "'" << needle << "' not in: " << saved.message();
    EXPECT_FALSE(std::filesystem::exists(path));
    EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
    EXPECT_FALSE(tr.save_gradients(path).is_ok());
    EXPECT_FALSE(std::filesystem::exists(path));
    EXPECT_FALSE(tr.read_floats("master.transformer.wpe.weight").ok());
    EXPECT_FALSE(tr.read_floats("transformer.wpe.weight").ok());
    EXPECT_FALSE(tr.step(random_batches(2, 2, 8, 200)).ok());
    EXPECT_EQ(tr.steps_done(), done);
    EXPECT_FALSE(tr.init_parameters().is_ok());
    EXPECT_FALSE(tr.write_parameter("transformer.wpe.weight", std::vector<float>(8 * 32, 0.0f)).is_ok());
    std::vector<uint16_t> stream(64, 1);
    TokenSplit split{.source = "test", .tokens = std::make_shared<const std::vector<uint16_t>>(stream)};
    auto loader = DataLoader::create(split, 1, 8, LoaderMode::Sequential);
    ASSERT_TRUE(loader.ok());
    EXPECT_FALSE(tr.evaluate(*loader, 1).ok());
  }
  EXPECT_GT(failed_steps, 0) << "no seed made a step fail inside the executor";
}

TEST(Trainer, SavedGradientsAreTheStepsGradients) {
  auto backend = cpu_backend();
  TrainerOptions o = micro_options();
  const std::string path = temp_path("grads.safetensors");
  auto t = Trainer::create(*backend, o);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->init_parameters().is_ok());
  ASSERT_TRUE((*t)->step(random_batches(o.shape.accum, o.shape.B, o.shape.T, 7)).ok());
  ASSERT_TRUE((*t)->save_gradients(path).is_ok());
  auto saved = import_model(path, o.model);  // back to our [out,in] layout
  ASSERT_TRUE(saved.ok()) << saved.status().to_string();
  int nonzero = 0;
  for (const ParamSpec& p : parameter_specs(o.model)) {
    auto grad = (*t)->read_floats("grad." + p.name);
    ASSERT_TRUE(grad.ok());
    const std::vector<float>& file = saved->at(p.name);
    ASSERT_EQ(file.size(), grad->size()) << p.name;
    for (size_t i = 0; i < file.size(); ++i) ASSERT_EQ(bits(file[i]), bits((*grad)[i])) << p.name << "[" << i << "]";
    for (float g : *grad) nonzero += g != 0.0f;
  }
  EXPECT_GT(nonzero, 0);
  std::filesystem::remove(path);
}

TEST(Trainer, SaveAndLoadRoundTrip) {
  auto backend = cpu_backend();
  TrainerOptions o = micro_options();
  const std::string path = temp_path("roundtrip.safetensors");
  auto a = Trainer::create(*backend, o);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE((*a)->init_parameters().is_ok());
  for (int s = 0; s < 3; ++s) ASSERT_TRUE((*a)->step(random_batches(2, 2, 8, s)).ok());
  ASSERT_TRUE((*a)->save(path).is_ok());

  auto cfg = infer_model_config(path);
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  EXPECT_EQ(*cfg, o.model);
  auto b = Trainer::create(*backend, o);
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE((*b)->load_parameters(path).is_ok());
  for (const ParamSpec& p : parameter_specs(o.model)) {
    auto va = (*a)->read_floats("master." + p.name);
    auto vb = (*b)->read_floats(p.name);
    ASSERT_TRUE(va.ok() && vb.ok());
    EXPECT_EQ(*va, *vb) << p.name;
  }
  // Same weights and moments reset on both: the next step agrees bit for bit only
  // if a's moments were reset too, so compare evaluation instead.
  auto data = random_batches(1, 2, 8, 99);
  std::vector<uint16_t> stream;
  for (int32_t tok : data[0].tokens) stream.push_back(static_cast<uint16_t>(tok));
  TokenSplit split{.source = "test", .tokens = std::make_shared<const std::vector<uint16_t>>(stream)};
  auto la = DataLoader::create(split, 1, 8, LoaderMode::Sequential);
  auto lb = DataLoader::create(split, 1, 8, LoaderMode::Sequential);
  ASSERT_TRUE(la.ok() && lb.ok());
  auto ea = (*a)->evaluate(*la, 2);
  auto eb = (*b)->evaluate(*lb, 2);
  ASSERT_TRUE(ea.ok()) << ea.status().to_string();
  ASSERT_TRUE(eb.ok()) << eb.status().to_string();
  EXPECT_EQ(bits(*ea), bits(*eb));

  // A checkpoint of another shape is refused with the importer's error.
  TrainerOptions wide = o;
  wide.model.width = 64;
  auto c = Trainer::create(*backend, wide);
  ASSERT_TRUE(c.ok());
  Status s = (*c)->load_parameters(path);
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
  std::filesystem::remove(path);
}

// --device-budget holds for the whole run, evaluation included: a run that trains
// and evaluates never has more device memory allocated (the backend's own count)
// than the budget, evaluation allocates none (it runs in the training arena's idle
// region), and it gives the unbudgeted run's value bit for bit.
TEST(Trainer, EvaluationStaysInsideTheDeviceBudget) {
  auto backend = cpu_backend();
  TrainerOptions o = micro_options();
  auto data = random_batches(1, 8, 8, 31);
  std::vector<uint16_t> stream;
  for (int32_t tok : data[0].tokens) stream.push_back(static_cast<uint16_t>(tok));
  TokenSplit split{.source = "test", .tokens = std::make_shared<const std::vector<uint16_t>>(stream)};
  auto evaluate = [&](Trainer& t) -> Result<float> {
    for (int s = 0; s < 2; ++s) {
      auto r = t.step(random_batches(o.shape.accum, o.shape.B, o.shape.T, 50 + s));
      if (!r.ok()) return r.status();
    }
    SPILLWAY_ASSIGN_OR_RETURN(auto loader, DataLoader::create(split, o.shape.B, o.shape.T, LoaderMode::Sequential));
    SPILLWAY_ASSIGN_OR_RETURN(float first, t.evaluate(loader, 2));
    loader.seek(0);
    SPILLWAY_ASSIGN_OR_RETURN(float again, t.evaluate(loader, 2));  // the cached plan, a new executor
    if (bits(first) != bits(again)) return Status::internal("evaluation changed between two calls");
    return first;
  };
  uint64_t full = 0;
  float reference = 0;
  {
    auto t = Trainer::create(*backend, o);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_TRUE((*t)->init_parameters().is_ok());
    full = (*t)->plan().device_bytes;
    auto v = evaluate(**t);
    ASSERT_TRUE(v.ok()) << v.status().to_string();
    reference = *v;
  }
  ASSERT_EQ(backend->device_used_bytes(), 0u);
  for (Policy policy : {Policy::Resident, Policy::Planned}) {
    for (uint64_t budget : {full, full / 2, full / 3}) {
      if (policy == Policy::Resident && budget < full) continue;
      SCOPED_TRACE(std::string(policy_name(policy)) + " budget " + std::to_string(budget));
      TrainerOptions b = o;
      b.planner.policy = policy;
      b.budgets.device = budget / 64 * 64;
      backend->reset_device_peak();
      auto t = Trainer::create(*backend, b);
      ASSERT_TRUE(t.ok()) << t.status().to_string();
      ASSERT_TRUE((*t)->init_parameters().is_ok());
      const size_t training = backend->device_used_bytes();
      auto v = evaluate(**t);
      ASSERT_TRUE(v.ok()) << v.status().to_string();
      EXPECT_EQ(bits(*v), bits(reference));
      EXPECT_LE(backend->device_peak_bytes(), b.budgets.device);
      EXPECT_EQ(backend->device_peak_bytes(), training);  // evaluation allocated no device memory
    }
  }
}

// A budget below what the whole-table embedding and LM head need: the trainer builds
// the step in vocab tiles, trains with the resident run's losses bit for bit, and
// saves and loads the whole table.
TEST(Trainer, VocabTilesUnderATightBudget) {
  auto backend = cpu_backend();
  TrainerOptions o = micro_options();
  o.model.vocab = static_cast<int>(2 * kVocabBlock + 1000);
  o.shape = {.B = 2, .T = 8, .accum = 1};
  auto batches = [&](uint64_t seed) {  // tokens from the whole vocabulary, so every tile is used
    std::vector<TokenBatch> out(1);
    uint64_t x = seed;
    for (int i = 0; i < 16; ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      out[0].tokens.push_back(static_cast<int32_t>((x >> 33) % static_cast<uint64_t>(o.model.vocab)));
      out[0].targets.push_back(static_cast<int32_t>((x >> 13) % static_cast<uint64_t>(o.model.vocab)));
    }
    return out;
  };
  auto resident = Trainer::create(*backend, o);
  ASSERT_TRUE(resident.ok()) << resident.status().to_string();
  EXPECT_EQ((*resident)->program().pieces("transformer.wte.weight").size(), 1u);
  const uint64_t untiled_minimum = minimum_device_budget((*resident)->program(), backend->alignment());
  TrainerOptions tight = o;
  tight.planner.policy = Policy::Planned;
  tight.budgets.device = untiled_minimum * 3 / 4;
  auto tiled = Trainer::create(*backend, tight);
  ASSERT_TRUE(tiled.ok()) << tiled.status().to_string();
  EXPECT_TRUE((*tiled)->options().shape.tile_vocab);
  EXPECT_EQ((*tiled)->program().pieces("grad.transformer.wte.weight").size(), 3u);
  ASSERT_TRUE((*resident)->init_parameters().is_ok());
  ASSERT_TRUE((*tiled)->init_parameters().is_ok());
  for (int step = 0; step < 3; ++step) {
    auto a = (*resident)->step(batches(step));
    auto b = (*tiled)->step(batches(step));
    ASSERT_TRUE(a.ok() && b.ok()) << a.status().to_string() << " / " << b.status().to_string();
    EXPECT_EQ(bits(a->loss), bits(b->loss)) << "step " << step + 1;
    EXPECT_EQ(bits(a->grad_norm), bits(b->grad_norm)) << "step " << step + 1;
    EXPECT_LE(b->exec.peak_device_bytes, tight.budgets.device);
  }
  const std::string path = temp_path("tiles.safetensors");
  ASSERT_TRUE((*tiled)->save(path).is_ok());
  auto loaded = Trainer::create(*backend, o);
  ASSERT_TRUE(loaded.ok());
  ASSERT_TRUE((*loaded)->load_parameters(path).is_ok());
  auto whole = (*resident)->read_floats("master.transformer.wte.weight");
  auto back = (*loaded)->read_floats("transformer.wte.weight");
  ASSERT_TRUE(whole.ok() && back.ok());
  EXPECT_EQ(*whole, *back);
  std::filesystem::remove(path);
}

TEST(Sampler, GreedyIsDeterministicAndSeedsMatter) {
  auto backend = cpu_backend();
  TrainerOptions o = micro_options();
  const std::string path = temp_path("sampler.safetensors");
  auto t = Trainer::create(*backend, o);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->init_parameters().is_ok());
  ASSERT_TRUE((*t)->save(path).is_ok());
  auto s = Sampler::create(*backend, o.model);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  ASSERT_TRUE((*s)->load(path).is_ok());
  const auto prompt = byte_encode("To be");
  auto g1 = (*s)->generate(prompt, 12, {.temperature = 0, .seed = 1});
  auto g2 = (*s)->generate(prompt, 12, {.temperature = 0, .seed = 2});
  ASSERT_TRUE(g1.ok()) << g1.status().to_string();
  ASSERT_TRUE(g2.ok());
  EXPECT_EQ(g1->size(), 12u);
  EXPECT_EQ(*g1, *g2);  // greedy ignores the seed
  auto r1 = (*s)->generate(prompt, 12, {.temperature = 1, .seed = 1});
  auto r2 = (*s)->generate(prompt, 12, {.temperature = 1, .seed = 1});
  auto r3 = (*s)->generate(prompt, 12, {.temperature = 1, .seed = 3});
  ASSERT_TRUE(r1.ok() && r2.ok() && r3.ok());
  EXPECT_EQ(*r1, *r2);
  EXPECT_NE(*r1, *r3);
  // Greedy picks the argmax of the logits of the last prompt position.
  auto logits = (*s)->next_logits(prompt);
  ASSERT_TRUE(logits.ok());
  EXPECT_EQ((*g1)[0], static_cast<int32_t>(std::max_element(logits->begin(), logits->end()) - logits->begin()));
  EXPECT_FALSE((*s)->generate({}, 3, {}).ok());
  // A tokenizer's vocabulary below the model's: only its ids are drawn, at any
  // temperature (the others' logits do not count), and a limit past the model's is refused.
  const int limit = 7;
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    auto hot = (*s)->generate(prompt, 24, {.temperature = 50, .seed = seed, .vocab_limit = limit});
    ASSERT_TRUE(hot.ok()) << hot.status().to_string();
    for (int32_t id : *hot) EXPECT_LT(id, limit);
  }
  auto greedy = (*s)->generate(prompt, 1, {.temperature = 0, .vocab_limit = limit});
  ASSERT_TRUE(greedy.ok());
  EXPECT_EQ((*greedy)[0], static_cast<int32_t>(std::max_element(logits->begin(), logits->begin() + limit) -
                                               logits->begin()));
  EXPECT_FALSE((*s)->generate(prompt, 1, {.vocab_limit = o.model.vocab + 1}).ok());
  std::filesystem::remove(path);
}

// The logits rows are padded (vocab 100 in rows of 128): the sampler's logits of a
// position give the same loss as the evaluation program's cross-entropy there.
TEST(Sampler, LogitsOfAPaddedVocabularyAgreeWithTheLoss) {
  auto backend = cpu_backend();
  TrainerOptions o = micro_options();
  o.model.vocab = 100;
  ASSERT_EQ(logits_row_stride(o.model.vocab), 128);
  const std::string path = temp_path("padded.safetensors");
  auto t = Trainer::create(*backend, o);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->init_parameters().is_ok());
  ASSERT_TRUE((*t)->save(path).is_ok());
  SamplerOptions two_tokens;
  two_tokens.window = 2;
  auto s = Sampler::create(*backend, o.model, two_tokens);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  ASSERT_TRUE((*s)->load(path).is_ok());
  // -log softmax(logits of the prompt's last position)[target]
  auto loss_of = [&](const std::vector<int32_t>& prompt, int32_t target) -> double {
    auto logits = (*s)->next_logits(prompt);
    EXPECT_TRUE(logits.ok()) << logits.status().to_string();
    if (!logits.ok()) return NAN;
    EXPECT_EQ(logits->size(), 100u);
    double m = *std::max_element(logits->begin(), logits->end()), sum = 0;
    for (float x : *logits) sum += std::exp(static_cast<double>(x) - m);
    return std::log(sum) - (static_cast<double>((*logits)[static_cast<size_t>(target)]) - m);
  };
  for (int32_t a : {3, 57, 99}) {
    const int32_t c = (a * 17 + 5) % o.model.vocab, b = (a * 31 + 7) % o.model.vocab;
    // Positions 0 (c → a) and 1 (a → b, read at row 1 of the padded logits).
    const double expected = (loss_of({c}, a) + loss_of({c, a}, b)) / 2;
    TokenSplit split{.source = "test",
                     .tokens = std::make_shared<const std::vector<uint16_t>>(std::vector<uint16_t>{
                         static_cast<uint16_t>(c), static_cast<uint16_t>(a), static_cast<uint16_t>(b)})};
    auto loader = DataLoader::create(split, 1, 2, LoaderMode::Sequential);
    ASSERT_TRUE(loader.ok()) << loader.status().to_string();
    auto eval = (*t)->evaluate(*loader, 1);
    ASSERT_TRUE(eval.ok()) << eval.status().to_string();
    EXPECT_NEAR(*eval, expected, 1e-5) << c << " " << a << " " << b;
  }
  std::filesystem::remove(path);
}

TEST(Sampler, PickToken) {
  std::vector<float> logits = {0.0f, 3.0f, 1.0f, 3.0f};
  EXPECT_EQ(pick_token(logits, 0, 0.5), 1);  // ties: the lowest index
  EXPECT_EQ(pick_token(logits, 1, 0.0), 0);
  EXPECT_EQ(pick_token(logits, 1, 0.999999), 3);
  // At a tiny temperature all mass is on the two maxima.
  EXPECT_EQ(pick_token(logits, 1e-3f, 0.25), 1);
  EXPECT_EQ(pick_token(logits, 1e-3f, 0.75), 3);
}

// The default tiny model on the bundled corpus gets below the bigram entropy of
// the text (2.45 nats/byte) on the validation split: 300 steps of 16x64 tokens,
// about 30-45 s on two cores; it reaches about 2.25.
TEST(TrainerConvergence, TinyBeatsBigramEntropy) {
  const std::string data_path = std::string(SPILLWAY_SOURCE_DIR) + "/data/tinyshakespeare.txt";
  auto data = load_dataset(data_path, 256);
  ASSERT_TRUE(data.ok()) << data.status().to_string();
  auto backend = cpu_backend();
  TrainerOptions o;
  o.model = *model_preset("tiny");
  o.shape = {.B = 16, .T = 64, .accum = 1};
  const int steps = 300;
  o.schedule = {.peak = 4e-3f, .warmup_steps = 20, .total_steps = steps};
  o.machine = Machine::cpu_dev_box();
  auto t = Trainer::create(*backend, o);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  ASSERT_TRUE((*t)->init_parameters().is_ok());
  auto train = DataLoader::create(data->train, 16, 64, LoaderMode::Random, o.seed);
  auto val = DataLoader::create(data->val, 16, 64, LoaderMode::Sequential);
  ASSERT_TRUE(train.ok() && val.ok());
  const auto t0 = std::chrono::steady_clock::now();
  float last = 0;
  for (int s = 0; s < steps; ++s) {
    auto r = (*t)->step(*train);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    last = r->loss;
  }
  auto v = (*t)->evaluate(*val, 20);
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("tiny after %d steps: train loss %.4f, val loss %.4f (%.1f s)\n", steps, last, *v, secs);
  EXPECT_LT(*v, 2.45f);
}

}  // namespace
}  // namespace spillway
