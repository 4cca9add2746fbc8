// Checkpoints (issue 11): exact resume under every policy and across a change of
// policy or budget, verification of every file, fallback to an older checkpoint, and
// keeping the newest K.
#include <gtest/gtest.h>
#include <sys/mount.h>

#include <cerrno>
#include <chrono>
#include <thread>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/model.h"
#include "plan/planner.h"
#include "sim/machine.h"
#include "support/test_support.h"
#include "support/trainer_support.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace spillway {
namespace {

namespace fs = std::filesystem;

using testing_support::float_bits;
using testing_support::learnable_batches;

TrainerOptions base_options() {
  TrainerOptions o;
  o.model = {.layers = 2, .width = 32, .heads = 2, .context = 16, .vocab = 64};
  o.shape = {.B = 2, .T = 16, .accum = 2};
  o.schedule = {.peak = 1e-2f, .warmup_steps = 2, .total_steps = 8};
  o.seed = 7;
  o.machine = Machine::cpu_dev_box();
  return o;
}

struct StateRun {
  std::vector<float> losses;
  std::vector<std::vector<uint8_t>> state;  // every state tensor after the last step
};

// Steps [from, to] (1-based) on `t`, then its state.
void steps(Trainer& t, int from, int to, StateRun& run) {
  for (int s = from; s <= to; ++s) {
    auto r = t.step(learnable_batches(2, 2, 16, 100 + s));
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    run.losses.push_back(r->loss);
  }
  run.state.clear();
  for (TensorId id : t.state_tensors()) {
    run.state.emplace_back();
    ASSERT_TRUE(t.read_state_tensor(id, run.state.back()).is_ok());
  }
  // The parameters, which a checkpoint leaves out and a resume makes again from the
  // master weights.
  for (size_t i = 0; i < t.program().tensors.size(); ++i) {
    const auto id = static_cast<TensorId>(i);
    if (t.program().tensors.info(id).role != Role::Param) continue;
    run.state.emplace_back();
    ASSERT_TRUE(t.read_state_tensor(id, run.state.back()).is_ok());
  }
}

TEST(Checkpoint, ResumeGivesTheUninterruptedRunsBitsUnderEveryPolicyAndAcrossAChange) {
  auto backend = make_backend("cpu", {.threads = 2});
  ASSERT_TRUE(backend.ok());
  Backend& b = **backend;
  const TrainerOptions base = base_options();
  StateRun straight;
  {
    auto t = Trainer::create(b, base);
    ASSERT_TRUE(t.ok());
    ASSERT_TRUE((*t)->init_parameters().is_ok());
    steps(**t, 1, 8, straight);
  }
  uint64_t full = 0;
  {
    auto t = Trainer::create(b, base);
    ASSERT_TRUE(t.ok());
    full = (*t)->plan().device_bytes;
  }
  testing_support::TempDir spill;
  auto with = [&](Policy p, uint64_t device, uint64_t host) {
    TrainerOptions o = base;
    o.planner.policy = p;
    if (device) o.budgets.device = device;
    if (host) {
      o.budgets.host = host;
      o.budgets.storage = 64 << 20;
      o.spill_dir = spill.path();
    }
    return o;
  };
  struct Case {
    const char* name;
    TrainerOptions first, second;
  };
  const std::vector<Case> cases = {
      {"resident", base, base},
      {"planned 1/4", with(Policy::Planned, full / 4, 0), with(Policy::Planned, full / 4, 0)},
      {"paging 1/2", with(Policy::Paging, full / 2, 0), with(Policy::Paging, full / 2, 0)},
      {"planned with storage", with(Policy::Planned, full / 4, 512 * 1024), with(Policy::Planned, full / 4, 512 * 1024)},
      {"resident, then planned 1/4", base, with(Policy::Planned, full / 4, 0)},
      {"planned 1/2, then paging 1/4", with(Policy::Planned, full / 2, 0), with(Policy::Paging, full / 4, 0)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    testing_support::TempDir dir;
    StateRun resumed;
    {
      auto t = Trainer::create(b, c.first);
      ASSERT_TRUE(t.ok()) << t.status().to_string();
      ASSERT_TRUE((*t)->init_parameters().is_ok());
      steps(**t, 1, 4, resumed);
      auto path = write_checkpoint(**t, dir.path(), {.step = 4, .data_batch = 0, .config = {{"run", "test"}}}, 2);
      ASSERT_TRUE(path.ok()) << path.status().to_string();
      EXPECT_EQ(fs::path(*path).filename(), "ckpt-00000004");
    }
    std::vector<std::string> skipped;
    auto c4 = newest_checkpoint(dir.path(), &skipped);
    ASSERT_TRUE(c4.ok()) << c4.status().to_string();
    EXPECT_TRUE(skipped.empty());
    EXPECT_EQ(c4->meta.step, 4);
    EXPECT_EQ(c4->meta.config, nlohmann::json({{"run", "test"}}));
    auto t = Trainer::create(b, c.second);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_TRUE(load_checkpoint(**t, *c4).is_ok());
    EXPECT_EQ((*t)->steps_done(), 4);
    steps(**t, 5, 8, resumed);
    ASSERT_EQ(resumed.losses.size(), straight.losses.size());
    for (size_t i = 0; i < straight.losses.size(); ++i)
      EXPECT_EQ(float_bits(resumed.losses[i]), float_bits(straight.losses[i])) << "step " << i + 1;
    EXPECT_TRUE(resumed.state == straight.state) << "the state after step 8 differs";
  }
}

// Writes checkpoints at steps 1, 2, 3 (keeping 2), then damages the newest.
struct Fixture {
  testing_support::TempDir dir;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Trainer> trainer;
  Fixture() {
    auto b = make_backend("cpu", {.threads = 2});
    backend = std::move(*b);
    auto t = Trainer::create(*backend, base_options());
    trainer = std::move(*t);
    EXPECT_TRUE(trainer->init_parameters().is_ok());
    for (int s = 1; s <= 3; ++s) {
      EXPECT_TRUE(trainer->step(learnable_batches(2, 2, 16, s)).ok());
      auto p = write_checkpoint(*trainer, dir.path(), {.step = s, .data_batch = s, .config = {}}, 2);
      EXPECT_TRUE(p.ok()) << p.status().to_string();
    }
  }
  std::string newest() const { return dir.path() + "/ckpt-00000003"; }
};

TEST(Checkpoint, KeepsTheNewestKAndLeavesNoTemporaryFolder) {
  Fixture f;
  std::vector<std::string> names = testing_support::names_in(f.dir.path());
  EXPECT_EQ(names, (std::vector<std::string>{"ckpt-00000002", "ckpt-00000003"}));
  auto list = list_checkpoints(f.dir.path());
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[0].step, 3);
  EXPECT_TRUE((*list)[0].status.is_ok());
  EXPECT_GT((*list)[0].bytes, 0u);
}

TEST(Checkpoint, EachKindOfDamageHasItsErrorAndResumeFallsBack) {
  struct Damage {
    const char* name;
    std::function<void(const std::string&)> apply;
    const char* expect;  // in the error
  };
  const std::vector<Damage> damages = {
      {"flipped byte",
       [](const std::string& d) {
         std::fstream f(d + "/state.bin", std::ios::in | std::ios::out | std::ios::binary);
         f.seekg(100);
         char c = 0;
         f.read(&c, 1);
         c = static_cast<char>(c ^ 0x20);
         f.seekp(100);
         f.write(&c, 1);
       },
       "checksum"},
      {"truncated", [](const std::string& d) { fs::resize_file(d + "/state.bin", 1000); }, "truncated"},
      {"missing state", [](const std::string& d) { fs::remove(d + "/state.bin"); }, "state.bin"},
      {"missing manifest", [](const std::string& d) { fs::remove(d + "/manifest.json"); }, "manifest.json: missing"},
      {"another version",
       [](const std::string& d) {
         std::ifstream in(d + "/manifest.json");
         nlohmann::json m = nlohmann::json::parse(in);
         m["version"] = 99;
         std::ofstream(d + "/manifest.json") << m.dump();
       },
       "format version 99"},
      {"not json", [](const std::string& d) { std::ofstream(d + "/manifest.json") << "{ nope"; }, "not JSON"},
  };
  for (const Damage& d : damages) {
    SCOPED_TRACE(d.name);
    Fixture f;
    d.apply(f.newest());
    auto r = read_checkpoint(f.newest());
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find(d.expect), std::string::npos) << r.status().to_string();
    std::vector<std::string> skipped;
    auto c = newest_checkpoint(f.dir.path(), &skipped);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    EXPECT_EQ(c->meta.step, 2);  // fell back
    ASSERT_EQ(skipped.size(), 1u);
    EXPECT_EQ(skipped[0].rfind("ckpt-00000003: ", 0), 0u) << skipped[0];
  }
}

TEST(Checkpoint, AModelOfAnotherShapeIsRefusedByName) {
  Fixture f;
  auto c = newest_checkpoint(f.dir.path(), nullptr);
  ASSERT_TRUE(c.ok());
  TrainerOptions wide = base_options();
  wide.model.width = 64;
  auto t = Trainer::create(*f.backend, wide);
  ASSERT_TRUE(t.ok());
  Status s = load_checkpoint(**t, *c);
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("this run's is"), std::string::npos) << s.to_string();
}

// A checkpoint that does not fit on its file system (ENOSPC halfway through
// state.bin) fails with an error naming the folder and the bytes it needed; the
// previous checkpoints stay whole and no temporary folder is left. Needs a 1 MiB
// tmpfs (mount(2), as root); skipped where the test cannot make one.
TEST(Checkpoint, AFullDiskKeepsThePreviousCheckpoint) {
  testing_support::TempDir dir;
  if (::mount("tmpfs", dir.path().c_str(), "tmpfs", 0, "size=1m") != 0)
    GTEST_SKIP() << "cannot mount a small tmpfs here (" << std::strerror(errno) << ")";
  struct Unmount {
    std::string path;
    ~Unmount() { ::umount2(path.c_str(), MNT_DETACH); }
  } unmount{dir.path()};
  auto backend = make_backend("cpu", {.threads = 2});
  ASSERT_TRUE(backend.ok());
  auto t = Trainer::create(**backend, base_options());
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->init_parameters().is_ok());
  Status failure;
  int written = 0;
  // Foreground writes first, then background ones (their error comes from wait()).
  CheckpointWriter writer(dir.path() + "/ck", 10, CheckpointWriter::Mode::Background);
  for (int s = 1; s <= 6 && failure.is_ok(); ++s) {
    ASSERT_TRUE((*t)->step(learnable_batches(2, 2, 16, s)).ok());
    const CheckpointMeta meta{.step = s, .data_batch = s, .config = {}};
    if (s <= 2) {
      auto p = write_checkpoint(**t, dir.path() + "/ck", meta, 10);
      if (p.ok()) ++written;
      else failure = p.status();
      continue;
    }
    failure = writer.begin(**t, meta);
    if (!failure.is_ok()) break;
    while (writer.busy()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (Status polled = writer.poll(); !polled.is_ok()) {
      // The failed write is reported again by the next begin(), once.
      Status next = writer.begin(**t, meta);
      EXPECT_EQ(next.to_string(), polled.to_string());
      failure = polled;
      break;
    }
    auto p = writer.wait();
    ASSERT_TRUE(p.ok());
    ++written;
  }
  ASSERT_FALSE(failure.is_ok()) << "every checkpoint fitted in 1 MiB: the model is too small for this test";
  ASSERT_GT(written, 0);
  std::printf("the full disk: %s\n", failure.to_string().c_str());
  EXPECT_NE(failure.message().find(dir.path() + "/ck/ckpt-"), std::string::npos) << failure.to_string();
  EXPECT_NE(failure.message().find("of state"), std::string::npos) << failure.to_string();
  EXPECT_NE(failure.message().find("No space"), std::string::npos) << failure.to_string();
  auto list = list_checkpoints(dir.path() + "/ck");
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), static_cast<size_t>(written));
  for (const CheckpointListing& c : *list) EXPECT_TRUE(c.status.is_ok()) << c.path << ": " << c.status.to_string();
  for (const auto& e : fs::directory_iterator(dir.path() + "/ck"))
    EXPECT_EQ(e.path().filename().string().rfind("ckpt-", 0), 0u) << "left behind: " << e.path();
}

// A background checkpoint is the snapshot of its step: steps run while it is
// written, its state.bin is byte for byte the foreground writer's of the same
// step, and resuming from it gives the uninterrupted run's bits. Under a budget
// that puts state on device, host and storage.
TEST(Checkpoint, ABackgroundWriteIsTheSnapshotOfItsStep) {
  auto backend = make_backend("cpu", {.threads = 2});
  ASSERT_TRUE(backend.ok());
  Backend& b = **backend;
  uint64_t full = 0;
  {
    auto t = Trainer::create(b, base_options());
    ASSERT_TRUE(t.ok());
    full = (*t)->plan().device_bytes;
  }
  testing_support::TempDir spill, bg;
  TrainerOptions o = base_options();
  o.planner.policy = Policy::Planned;
  o.budgets.device = full / 4;
  o.budgets.host = 512 * 1024;
  o.budgets.storage = 64 << 20;
  o.spill_dir = spill.path();
  StateRun straight, resumed;
  {
    auto t = Trainer::create(b, o);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_TRUE((*t)->init_parameters().is_ok());
    steps(**t, 1, 8, straight);
  }
  // Staged device copies (no backend to pin with), then copies straight into the
  // pinned snapshot that the next steps' writers of those tensors wait for: in a
  // resident run, where the whole state is on device (the same bits: exactness).
  for (bool pinned : {false, true}) {
    SCOPED_TRACE(pinned ? "pinned snapshot, resident" : "staged device copies, planned with storage");
    testing_support::TempDir fg_run, bg_run;
    StateRun first;
    TrainerOptions resident = base_options();
    resident.planner.policy = Policy::Resident;
    auto t = Trainer::create(b, pinned ? resident : o);
    ASSERT_TRUE(t.ok());
    ASSERT_TRUE((*t)->init_parameters().is_ok());
    steps(**t, 1, 4, first);
    auto f = write_checkpoint(**t, fg_run.path(), {.step = 4, .data_batch = 4, .config = {}}, 2);
    ASSERT_TRUE(f.ok()) << f.status().to_string();
    CheckpointWriter writer(bg_run.path(), 2, CheckpointWriter::Mode::Background);
    if (pinned) writer.prepare((*t)->state_bytes(), &b);
    ASSERT_TRUE(writer.begin(**t, {.step = 4, .data_batch = 4, .config = {}}).is_ok());
    EXPECT_EQ(writer.last_snapshot().device_copies.has_value(), pinned && writer.last_snapshot().device_bytes > 0);
    if (pinned) {
      EXPECT_GT(writer.last_snapshot().device_bytes, 0u) << "the test needs device-resident state";
    }
    StateRun more;
    steps(**t, 5, 8, more);  // while the checkpoint of step 4 is written
    EXPECT_TRUE(more.losses.size() == 4 && more.state == straight.state);
    auto p = writer.wait();
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    EXPECT_EQ(*p, bg_run.path() + "/ckpt-00000004");
    EXPECT_EQ(writer.last_path(), *p);
    EXPECT_TRUE(writer.sync_reason().empty());
    EXPECT_EQ(testing_support::read_file(*p + "/state.bin"), testing_support::read_file(*f + "/state.bin"));
    auto again = writer.wait();  // nothing in flight
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(*again, "");
    if (pinned) {
      resumed = first;
      std::filesystem::rename(*p, bg.path() + "/ckpt-00000004");
    }
  }
  std::vector<std::string> skipped;
  auto c = newest_checkpoint(bg.path(), &skipped);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  auto t = Trainer::create(b, o);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(load_checkpoint(**t, *c).is_ok());
  steps(**t, 5, 8, resumed);
  ASSERT_EQ(resumed.losses.size(), straight.losses.size());
  for (size_t i = 0; i < straight.losses.size(); ++i)
    EXPECT_EQ(float_bits(resumed.losses[i]), float_bits(straight.losses[i])) << "step " << i + 1;
  EXPECT_TRUE(resumed.state == straight.state);
}

// Speculative updates swap the buffers of master weights and moments: checkpoints
// (foreground and background, the latter while the next steps run) still hold the
// state of their step, and a run resumed from one gives the uninterrupted run's bits.
TEST(Checkpoint, SpeculativeUpdatesKeepCheckpointsExact) {
  auto backend = make_backend("cpu", {.threads = 2});
  ASSERT_TRUE(backend.ok());
  Backend& b = **backend;
  TrainerOptions o = base_options();
  o.max_grad_norm = 1e6f;  // clipping inactive: every speculation stands
  uint64_t full = 0;
  {
    auto t = Trainer::create(b, o);
    ASSERT_TRUE(t.ok());
    full = (*t)->plan().device_bytes;
  }
  o.planner.policy = Policy::Planned;
  o.planner.optimizer_on_host = 1;
  o.planner.device_optimizer_bytes = 0;
  o.planner.speculate = 1;  // what is under test, whichever the cost model prefers
  o.budgets.device = full / 2;
  StateRun straight, first, more, resumed;
  {
    auto t = Trainer::create(b, o);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_FALSE((*t)->plan().speculation.empty()) << (*t)->plan().description;
    ASSERT_TRUE((*t)->init_parameters().is_ok());
    steps(**t, 1, 8, straight);
    ASSERT_TRUE((*t)->drain().is_ok());
    const SpeculationTally tally = (*t)->executor().speculation_tally();
    EXPECT_EQ(tally.committed, 8 * (*t)->plan().speculation.size());
    EXPECT_EQ(tally.redone, 0u);
  }
  testing_support::TempDir fg, bg;
  auto t = Trainer::create(b, o);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->init_parameters().is_ok());
  // After step 3: an odd number of commits, so master and moments are in the
  // buffers they did not start in.
  steps(**t, 1, 3, first);
  auto f = write_checkpoint(**t, fg.path(), {.step = 3, .data_batch = 3, .config = {}}, 2);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  CheckpointWriter writer(bg.path(), 2, CheckpointWriter::Mode::Background);
  writer.prepare((*t)->state_bytes());
  ASSERT_TRUE(writer.begin(**t, {.step = 3, .data_batch = 3, .config = {}}).is_ok());
  steps(**t, 4, 8, more);  // while the checkpoint of step 3 is written
  EXPECT_TRUE(more.state == straight.state);
  auto p = writer.wait();
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(testing_support::read_file(*p + "/state.bin"), testing_support::read_file(*f + "/state.bin"));
  std::vector<std::string> skipped;
  auto c = newest_checkpoint(bg.path(), &skipped);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  auto again = Trainer::create(b, o);
  ASSERT_TRUE(again.ok());
  ASSERT_TRUE(load_checkpoint(**again, *c).is_ok());
  resumed = first;
  steps(**again, 4, 8, resumed);
  ASSERT_EQ(resumed.losses.size(), straight.losses.size());
  for (size_t i = 0; i < straight.losses.size(); ++i)
    EXPECT_EQ(float_bits(resumed.losses[i]), float_bits(straight.losses[i])) << "step " << i + 1;
  EXPECT_TRUE(resumed.state == straight.state);
}

// A checkpoint folder that cannot be made fails begin() at once, naming it;
// nothing is left in flight.
TEST(Checkpoint, ABackgroundCheckpointWhoseFolderCannotBeMadeFailsAtOnce) {
  testing_support::TempDir dir;
  auto backend = make_backend("cpu", {.threads = 2});
  ASSERT_TRUE(backend.ok());
  auto t = Trainer::create(**backend, base_options());
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->init_parameters().is_ok());
  ASSERT_TRUE((*t)->step(learnable_batches(2, 2, 16, 1)).ok());
  const std::string file = dir.path() + "/not-a-folder";
  std::ofstream(file) << "x";
  CheckpointWriter writer(file, 2, CheckpointWriter::Mode::Background);
  Status s = writer.begin(**t, {.step = 1, .data_batch = 1, .config = {}});
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find(file), std::string::npos) << s.to_string();
  EXPECT_FALSE(writer.busy());
  auto w = writer.wait();
  EXPECT_TRUE(w.ok() && w->empty());
}

// Numbers of the wrong kind are errors, never conversions (a float such as 1e30 as
// a step or size was undefined behaviour to convert; found by the fuzzer).
TEST(Checkpoint, ManifestNumbersOfTheWrongKindAreErrors) {
  const std::string ok = R"({"format":"spillway-checkpoint","version":1,"step":3,"data_batch":3,"config":{},
    "tensors":[{"name":"a","dtype":"f32","shape":[2],"offset":0,"bytes":8,"xxh3":"0123456789abcdef"}],
    "files":[{"name":"state.bin","bytes":8,"xxh3":"0123456789abcdef"}]})";
  EXPECT_TRUE(parse_checkpoint_manifest(ok, "m").ok());
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"\"step\":3", "\"step\":1e30"},
           {"\"version\":1", "\"version\":1.5e300"},
           {"\"offset\":0", "\"offset\":-1"},
           {"\"bytes\":8,\"xxh3", "\"bytes\":8.5,\"xxh3"},
           {"\"shape\":[2]", "\"shape\":[2.5e40]"},
           {"\"data_batch\":3", "\"data_batch\":\"3\""}}) {
    std::string bad = ok;
    ASSERT_NE(bad.find(from), std::string::npos) << from;
    bad.replace(bad.find(from), from.size(), to);
    auto r = parse_checkpoint_manifest(bad, "m");
    EXPECT_FALSE(r.ok()) << to;
  }
}

}  // namespace
}  // namespace spillway
