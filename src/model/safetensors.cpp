#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <tuple>

#include "core/atomic_file.h"
#include "core/input_file.h"
#include "tensor/tensor.h"

namespace spillway {

static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // the limit of the reference implementation

// Bytes per element of a safetensors dtype; 0 when unknown.
size_t st_dtype_size(std::string_view d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  return 0;
}

std::string shape_text(const std::vector<int64_t>& s) { return Shape(s).to_string(); }

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  // Closes now and reports the error close() gives (it matters for writes).
  Status close(const std::string& path) {
    int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) return errno_status("close " + path, errno);
    return Status::ok();
  }

 private:
  int fd_;
};

Result<int> open_for_read(const std::string& path) { return open_regular_file(path, "safetensors file"); }

Status pread_all(int fd, const std::string& path, void* buf, size_t bytes, uint64_t offset) {
  char* p = static_cast<char*>(buf);
  size_t done = 0;
  while (done < bytes) {
    ssize_t n = ::pread(fd, p + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno_status("pread " + path + " at offset " + std::to_string(offset + done) + " (" +
                              std::to_string(bytes - done) + " bytes)",
                          errno);
    }
    if (n == 0)
      return Status::corrupt(path + ": file ends at offset " + std::to_string(offset + done) + ", expected " +
                             std::to_string(bytes - done) + " more bytes");
    done += static_cast<size_t>(n);
  }
  return Status::ok();
}

Status write_all(int fd, const std::string& path, const void* buf, size_t bytes, uint64_t offset) {
  const char* p = static_cast<const char*>(buf);
  size_t done = 0;
  while (done < bytes) {
    ssize_t n = ::write(fd, p + done, bytes - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno_status("write " + path + " at offset " + std::to_string(offset + done) + " (" +
                              std::to_string(bytes - done) + " bytes)",
                          errno);
    }
    done += static_cast<size_t>(n);
  }
  return Status::ok();
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h >> 15) << 31;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  if (exp == 0) {
    float v = std::ldexp(static_cast<float>(mant), -24);  // zero or subnormal, exact
    return sign ? -v : v;
  }
  uint32_t bits = exp == 31 ? (sign | 0x7f800000u | (mant << 13)) : (sign | ((exp + 112) << 23) | (mant << 13));
  return std::bit_cast<float>(bits);
}

}  // namespace

int64_t SafetensorsEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Result<SafetensorsReader> SafetensorsReader::open(const std::string& path) {
  SPILLWAY_ASSIGN_OR_RETURN(int raw_fd, open_for_read(path));
  Fd fd(raw_fd);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return errno_status("fstat " + path, errno);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  auto corrupt = [&](const std::string& what) { return Status::corrupt("safetensors file " + path + ": " + what); };
  if (size < 8)
    return corrupt("file is " + std::to_string(size) + " bytes, too short for the 8-byte header length");
  uint8_t len_bytes[8];
  SPILLWAY_RETURN_IF_ERROR(pread_all(fd.get(), path, len_bytes, 8, 0));
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  if (header_len > size - 8)
    return corrupt("header length " + std::to_string(header_len) + " runs past the end of the file (" +
                   std::to_string(size) + " bytes)");
  if (header_len > kMaxHeaderBytes)
    return corrupt("header length " + std::to_string(header_len) + " exceeds the " +
                   std::to_string(kMaxHeaderBytes) + "-byte limit");
  std::string header(header_len, '\0');
  SPILLWAY_RETURN_IF_ERROR(pread_all(fd.get(), path, header.data(), header_len, 8));
  nlohmann::json j = nlohmann::json::parse(header, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return corrupt("header is not valid JSON");
  if (!j.is_object()) return corrupt("header is not a JSON object");

  SafetensorsReader r;
  r.path_ = path;
  r.data_start_ = 8 + header_len;
  const uint64_t data_size = size - r.data_start_;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return corrupt("__metadata__ is not a JSON object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) return corrupt("__metadata__ entry '" + m.key() + "' is not a string");
        r.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& what) { return corrupt("tensor '" + name + "': " + what); };
    if (!v.is_object()) return bad("entry is not a JSON object");
    if (!v.contains("dtype") || !v["dtype"].is_string()) return bad("missing or non-string \"dtype\"");
    if (!v.contains("shape") || !v["shape"].is_array()) return bad("missing or non-array \"shape\"");
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2 ||
        !v["data_offsets"][0].is_number_unsigned() || !v["data_offsets"][1].is_number_unsigned())
      return bad("\"data_offsets\" is not two non-negative integers");
    SafetensorsEntry e;
    e.name = name;
    e.dtype = v["dtype"].get<std::string>();
    size_t esize = st_dtype_size(e.dtype);
    if (esize == 0) return bad("unknown dtype '" + e.dtype + "'");
    unsigned __int128 numel = 1;
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned()) return bad("shape has an entry that is not a non-negative integer");
      uint64_t dim = d.get<uint64_t>();
      if (dim > (1ull << 40)) return bad("shape dimension " + std::to_string(dim) + " is implausibly large");
      e.shape.push_back(static_cast<int64_t>(dim));
      numel *= dim;
      if (numel > (static_cast<unsigned __int128>(1) << 62)) return bad("shape has too many elements");
    }
    e.begin = v["data_offsets"][0].get<uint64_t>();
    e.end = v["data_offsets"][1].get<uint64_t>();
    if (e.begin > e.end || e.end > data_size)
      return bad("data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                 "] out of range of the data buffer (" + std::to_string(data_size) + " bytes)");
    unsigned __int128 want = numel * esize;
    if (want != e.end - e.begin)
      return bad("data_offsets span " + std::to_string(e.end - e.begin) + " bytes; dtype " + e.dtype + " and shape " +
                 shape_text(e.shape) + " need " + std::to_string(static_cast<uint64_t>(want)));
    r.entries_.push_back(std::move(e));
  }
  std::sort(r.entries_.begin(), r.entries_.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  // As the reference implementation requires: in order of their offsets, the tensors
  // tile the data buffer, each starting where the previous one ends, with no overlap,
  // no gap and nothing after the last.
  auto range = [](const SafetensorsEntry& e) {
    return "'" + e.name + "' (data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + "])";
  };
  uint64_t covered = 0;  // the data buffer's bytes [0, covered) belong to the tensors so far
  for (size_t i = 0; i < r.entries_.size(); ++i) {
    const SafetensorsEntry& e = r.entries_[i];
    if (e.begin < covered)
      return corrupt("tensors " + range(r.entries_[i - 1]) + " and " + range(e) +
                     " overlap; every tensor needs bytes of its own");
    if (e.begin > covered)
      return corrupt("bytes [" + std::to_string(covered) + ", " + std::to_string(e.begin) +
                     ") of the data buffer belong to no tensor: a gap " +
                     (i == 0 ? "before the first tensor " + range(e)
                             : "between tensors " + range(r.entries_[i - 1]) + " and " + range(e)));
    covered = e.end;
  }
  if (covered != data_size)
    return corrupt("the data buffer is " + std::to_string(data_size) + " bytes but the tensors end at byte " +
                   std::to_string(covered) +
                   (r.entries_.empty() ? std::string(" (there are none)") : " (the last is " + range(r.entries_.back()) + ")"));
  return r;
}

const SafetensorsEntry* SafetensorsReader::find(std::string_view name) const {
  for (const SafetensorsEntry& e : entries_)
    if (e.name == name) return &e;
  return nullptr;
}

Result<std::vector<float>> SafetensorsReader::read_f32(const SafetensorsEntry& e) const {
  return read_f32(e, 0, static_cast<uint64_t>(e.numel()));
}

Result<std::vector<float>> SafetensorsReader::read_f32(const SafetensorsEntry& e, uint64_t first,
                                                       uint64_t count) const {
  const uint64_t numel = static_cast<uint64_t>(e.numel());
  first = std::min(first, numel);
  const size_t n = static_cast<size_t>(std::min(count, numel - first));
  std::vector<float> out(n);
  if (e.dtype != "F32" && e.dtype != "F16" && e.dtype != "BF16")
    return Status::invalid_argument("safetensors file " + path_ + ": tensor '" + e.name + "' has dtype " + e.dtype +
                                    "; expected F32, F16 or BF16");
  SPILLWAY_ASSIGN_OR_RETURN(int raw_fd, open_for_read(path_));
  Fd fd(raw_fd);
  if (e.dtype == "F32") {
    SPILLWAY_RETURN_IF_ERROR(pread_all(fd.get(), path_, out.data(), n * 4, data_start_ + e.begin + first * 4));
    return out;
  }
  std::vector<uint16_t> half(n);
  SPILLWAY_RETURN_IF_ERROR(pread_all(fd.get(), path_, half.data(), n * 2, data_start_ + e.begin + first * 2));
  if (e.dtype == "BF16") {
    for (size_t i = 0; i < n; ++i) out[i] = std::bit_cast<float>(static_cast<uint32_t>(half[i]) << 16);
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = f16_to_f32(half[i]);
  }
  return out;
}

namespace {

// The header length, the header text and each tensor's values, into the new file
// `fd` (named `tmp` in errors).
Status write_file(int fd, const std::string& tmp, const std::string& text, const std::vector<SafetensorsTensor>& tensors) {
  uint8_t len_bytes[8];
  uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<uint8_t>(len >> (8 * i));
  uint64_t pos = 0;
  SPILLWAY_RETURN_IF_ERROR(write_all(fd, tmp, len_bytes, 8, pos));
  pos += 8;
  SPILLWAY_RETURN_IF_ERROR(write_all(fd, tmp, text.data(), text.size(), pos));
  pos += text.size();
  for (const SafetensorsTensor& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    if (!t.values) return Status::invalid_argument("tensor '" + t.name + "' has no values");
    SPILLWAY_ASSIGN_OR_RETURN(std::vector<float> values, t.values());
    if (static_cast<int64_t>(values.size()) != numel)
      return Status::invalid_argument("tensor '" + t.name + "' has " +
                                      std::to_string(values.size()) + " values; shape " + shape_text(t.shape) +
                                      " needs " + std::to_string(numel));
    SPILLWAY_RETURN_IF_ERROR(write_all(fd, tmp, values.data(), values.size() * 4, pos));
    pos += values.size() * 4;
  }
  return Status::ok();
}

}  // namespace

Status write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = m;
  }
  uint64_t offset = 0;
  std::set<std::string> seen;
  for (const SafetensorsTensor& t : tensors) {
    if (t.name == "__metadata__" || !seen.insert(t.name).second)
      return Status::invalid_argument("safetensors file " + path + ": tensor name '" + t.name +
                                      "' is reserved or appears twice");
    int64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) return Status::invalid_argument("safetensors file " + path + ": tensor '" + t.name +
                                                 "' has negative dimension in shape " + shape_text(t.shape));
      numel *= d;
    }
    uint64_t bytes = static_cast<uint64_t>(numel) * 4;
    header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  // PATH.tmp-<pid>-<random>, renamed onto PATH when whole (AtomicFile): an
  // interrupted or failed save leaves PATH as it was, and no temporary file.
  auto file = AtomicFile::create(path);
  if (!file) return file.status().with_context("safetensors file " + path);
  Status s = write_file(file->fd(), file->temp_path(), text, tensors);
  if (s.is_ok()) s = file->commit();
  if (!s.is_ok()) return s.with_context("safetensors file " + path);
  return Status::ok();
}


}  // namespace spillway
