#include "core/chrome_trace.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>


namespace spillway {

namespace {

constexpr int kPid = 1;
const char* const kStandardTracks[] = {"compute", "host", "h2d", "d2h", "storage read", "storage write"};

double micros(double s) { return s * 1e6; }

}  // namespace

Trace::Trace() {
  for (const char* t : kStandardTracks) track_id(t);
}

Trace::Trace(Trace&& other) noexcept {
  std::lock_guard<std::mutex> lock(other.mu_);
  tracks_ = std::move(other.tracks_);
  track_index_ = std::move(other.track_index_);
  slices_ = std::move(other.slices_);
  counters_ = std::move(other.counters_);
}

Trace& Trace::operator=(Trace&& other) noexcept {
  if (this == &other) return *this;
  std::scoped_lock lock(mu_, other.mu_);
  tracks_ = std::move(other.tracks_);
  track_index_ = std::move(other.track_index_);
  slices_ = std::move(other.slices_);
  counters_ = std::move(other.counters_);
  return *this;
}

int Trace::track_id(const std::string& track) {
  auto it = track_index_.find(track);
  if (it != track_index_.end()) return it->second;
  tracks_.push_back(track);
  const int id = static_cast<int>(tracks_.size());
  track_index_.emplace(track, id);
  return id;
}

void Trace::slice(std::string track, std::string name, double start_s, double end_s, nlohmann::json args) {
  std::lock_guard<std::mutex> lock(mu_);
  const int id = track_id(track);
  slices_.push_back({id, std::move(name), start_s, std::max(start_s, end_s), std::move(args)});
}

void Trace::counter(std::string name, double t_s, double value) {
  std::lock_guard<std::mutex> lock(mu_);
  counters_.push_back({std::move(name), t_s, value});
}

size_t Trace::slice_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return slices_.size();
}

size_t Trace::counter_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_.size();
}

nlohmann::json Trace::to_json() const {
  std::lock_guard<std::mutex> lock(mu_);
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", kPid}, {"args", {{"name", "spillway"}}}});
  for (size_t i = 0; i < tracks_.size(); ++i) {
    const int tid = static_cast<int>(i) + 1;
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", kPid}, {"tid", tid}, {"args", {{"name", tracks_[i]}}}});
    events.push_back(
        {{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", kPid}, {"tid", tid}, {"args", {{"sort_index", tid}}}});
  }
  for (const Slice& s : slices_) {
    nlohmann::json e = {{"name", s.name},       {"cat", tracks_[s.track - 1]}, {"ph", "X"},  {"pid", kPid},
                        {"tid", s.track},       {"ts", micros(s.start_s)},     {"dur", micros(s.end_s - s.start_s)}};
    if (!s.args.is_null() && !s.args.empty()) e["args"] = s.args;
    events.push_back(std::move(e));
  }
  for (const Counter& c : counters_)
    events.push_back({{"name", c.name}, {"ph", "C"}, {"pid", kPid}, {"ts", micros(c.t_s)}, {"args", {{"value", c.value}}}});
  return {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
}

Status Trace::write(const std::string& path) const {
  const std::string text = to_json().dump();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return errno_status("open trace file " + path, errno);
  const size_t written = std::fwrite(text.data(), 1, text.size(), f);
  const int write_err = written == text.size() ? 0 : (errno ? errno : EIO);
  const int close_rc = std::fclose(f);
  if (write_err) return errno_status("write trace file " + path, write_err);
  if (close_rc != 0) return errno_status("close trace file " + path, errno);
  return Status::ok();
}

}  // namespace spillway
