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

namespace spillway {

static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // the limit of the reference implementation
constexpr std::string_view kPrefix = "transformer.";

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

Result<int> open_for_read(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) return Status::not_found("safetensors file " + path + ": no such file");
    return errno_status("open " + path, err);
  }
  return fd;
}

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

std::string_view strip_prefix(std::string_view name) {
  return name.substr(0, kPrefix.size()) == kPrefix ? name.substr(kPrefix.size()) : name;
}

std::vector<int64_t> hf_shape(const ParamSpec& s) {
  std::vector<int64_t> d = s.shape.dims;
  if (s.conv1d) std::reverse(d.begin(), d.end());
  return d;
}

// out[o*in + i] = src[i*out + o]: Hugging Face Conv1D [in,out] ⇄ our [out,in].
std::vector<float> transpose(const std::vector<float>& src, int64_t rows, int64_t cols) {
  std::vector<float> out(src.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[static_cast<size_t>(c * rows + r)] = src[static_cast<size_t>(r * cols + c)];
  return out;
}

std::string list_names(const std::vector<std::string>& names, size_t max_shown = 10) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < max_shown; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > max_shown) s += ", and " + std::to_string(names.size() - max_shown) + " more";
  return s;
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
  const size_t n = static_cast<size_t>(e.numel());
  std::vector<float> out(n);
  if (e.dtype != "F32" && e.dtype != "F16" && e.dtype != "BF16")
    return Status::invalid_argument("safetensors file " + path_ + ": tensor '" + e.name + "' has dtype " + e.dtype +
                                    "; expected F32, F16 or BF16");
  SPILLWAY_ASSIGN_OR_RETURN(int raw_fd, open_for_read(path_));
  Fd fd(raw_fd);
  if (e.dtype == "F32") {
    SPILLWAY_RETURN_IF_ERROR(pread_all(fd.get(), path_, out.data(), n * 4, data_start_ + e.begin));
    return out;
  }
  std::vector<uint16_t> half(n);
  SPILLWAY_RETURN_IF_ERROR(pread_all(fd.get(), path_, half.data(), n * 2, data_start_ + e.begin));
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


// ---------------------------------------------------------------- GPT-2

namespace {

constexpr uint64_t kMaxConfigBytes = 16ull << 20;  // a Hugging Face config.json is a few KiB
const std::array<const char*, 5> kSizeNames = {"layers", "width", "heads", "context", "vocab"};

int& size_field(ModelConfig& c, size_t i) {
  int* fields[] = {&c.layers, &c.width, &c.heads, &c.context, &c.vocab};
  return *fields[i];
}
int size_field(const ModelConfig& c, size_t i) { return size_field(const_cast<ModelConfig&>(c), i); }

// The parameters of one block without the "h.{i}." prefix, in ParamSpec order.
const std::vector<std::string>& block_tensor_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    const std::string prefix = "transformer.h.0.";
    for (const ParamSpec& s : parameter_specs(ModelConfig{1, 1, 1, 1, 1}))
      if (s.layer == 0) n.push_back(s.name.substr(prefix.size()));
    return n;
  }();
  return names;
}

// "1024" → 1024: a plain decimal number in 1..kMaxModelDim, else nullopt.
std::optional<int> parse_size(std::string_view s) {
  int64_t v = 0;
  if (s.empty() || s.size() > 9 || (s.size() > 1 && s[0] == '0')) return std::nullopt;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  if (v < 1 || v > kMaxModelDim) return std::nullopt;
  return static_cast<int>(v);
}

// The sizes in the file's __metadata__ (as export_gpt2 writes them), as strings.
Result<StatedModelSizes> metadata_sizes(const SafetensorsReader& file) {
  StatedModelSizes s;
  s.source = "__metadata__ of " + file.path();
  const auto& meta = file.metadata();
  const bool positions = meta.count("n_positions") > 0;
  s.keys = {"n_layer", "n_embd", "n_head", positions ? "n_positions" : "n_ctx", "vocab_size"};
  for (size_t i = 0; i < s.keys.size(); ++i) {
    auto it = meta.find(s.keys[i]);
    if (it == meta.end()) continue;
    std::optional<int> v = parse_size(it->second);
    if (!v)
      return Status::invalid_argument("safetensors file " + file.path() + ": __metadata__ " + s.keys[i] + " '" +
                                      it->second + "' is not a positive integer up to 2^24");
    size_field(s.sizes, i) = *v;
  }
  return s;
}

// A block tensor's name, "h.3.ln_1.weight": digits "3", rest "ln_1.weight".
struct BlockName {
  bool is_block = false;  // of the form "h.<digits>.<rest>"
  int64_t index = -1;     // -1 unless the digits are a plain number below kMaxModelDim
  std::string_view digits, rest;
};

BlockName parse_block_name(std::string_view name) {
  BlockName b;
  if (name.substr(0, 2) != "h.") return b;
  size_t i = 2;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9') ++i;
  if (i == 2 || i >= name.size() || name[i] != '.') return b;
  b.is_block = true;
  b.digits = name.substr(2, i - 2);
  b.rest = name.substr(i + 1);
  if (b.digits.size() > 1 && b.digits[0] == '0') return b;  // "h.01.": not how blocks are named
  int64_t v = 0;
  for (char c : b.digits) {
    v = v * 10 + (c - '0');
    if (v >= kMaxModelDim) return b;  // stops before it could overflow
  }
  b.index = v;
  return b;
}

// L, the number of transformer blocks, after checking that the blocks are exactly
// h.0 … h.{L-1} and that each has all 12 parameters. The work is bounded by the
// number of tensors in the file, whatever the names say.
Result<int> gpt2_block_count(const SafetensorsReader& file) {
  auto fail = [&](const std::string& what) {
    return Status::invalid_argument("safetensors file " + file.path() + ": " + what);
  };
  std::map<int64_t, std::set<std::string_view>> blocks;  // index → the parameter names it has
  for (const SafetensorsEntry& e : file.entries()) {
    BlockName b = parse_block_name(strip_prefix(e.name));
    if (!b.is_block) continue;
    if (b.index < 0)
      return fail("tensor '" + e.name + "': block number " + std::string(b.digits) +
                  " is not a plain number below 2^24 = " + std::to_string(kMaxModelDim));
    blocks[b.index].insert(b.rest);
  }
  if (blocks.empty()) return fail("no transformer blocks (h.0.*)");
  const int64_t count = static_cast<int64_t>(blocks.size());
  const int64_t last = blocks.rbegin()->first;
  if (last != count - 1) {
    int64_t first_missing = 0;
    for (const auto& [i, names] : blocks) {
      if (i != first_missing) break;
      ++first_missing;
    }
    std::vector<std::string> found;
    for (const auto& [i, names] : blocks) found.push_back("h." + std::to_string(i));
    return fail("transformer blocks must be h.0 … h.{L-1} with none missing; the file has " +
                std::to_string(count) + " block(s) (" + list_names(found, 5) + ") and no h." +
                std::to_string(first_missing));
  }
  for (const auto& [i, names] : blocks) {
    std::vector<std::string> missing;
    for (const std::string& n : block_tensor_names())
      if (!names.count(n)) missing.push_back("h." + std::to_string(i) + "." + n);
    if (!missing.empty())
      return fail("block h." + std::to_string(i) + " is incomplete: it lacks " + std::to_string(missing.size()) +
                  " of its 12 parameters: " + list_names(missing));
  }
  return static_cast<int>(count);
}

// The file's entry for each ParamSpec of `cfg`, in order, after checking that the
// file holds exactly those parameters (plus the ignored buffers and tied lm_head) with
// their shapes and float dtypes. Errors name the file and the tensors.
Result<std::vector<const SafetensorsEntry*>> match_gpt2(const SafetensorsReader& file, const ModelConfig& cfg) {
  const std::string where = "safetensors file " + file.path();
  // Stored tensors by name without the "transformer." prefix.
  std::map<std::string, const SafetensorsEntry*, std::less<>> by_name;
  std::set<int64_t> block_indices;
  for (const SafetensorsEntry& e : file.entries()) {
    std::string_view n = strip_prefix(e.name);
    if (n == "lm_head.weight") continue;  // tied to wte
    BlockName b = parse_block_name(n);
    if (b.is_block && b.index >= 0) block_indices.insert(b.index);
    if (b.is_block && (b.rest == "attn.bias" || b.rest == "attn.masked_bias")) continue;  // buffers
    if (!by_name.emplace(std::string(n), &e).second)
      return Status::invalid_argument(where + ": tensor '" + std::string(n) +
                                      "' appears twice (with and without the transformer. prefix)");
  }
  // More blocks asked for than the file has: name the first missing one without
  // listing (or allocating) the parameters of every block of cfg.
  if (static_cast<size_t>(cfg.layers) > block_indices.size()) {
    int first_missing = 0;
    while (block_indices.count(first_missing)) ++first_missing;
    std::vector<std::string> names;
    for (const std::string& n : block_tensor_names()) names.push_back("h." + std::to_string(first_missing) + "." + n);
    return Status::not_found(where + ": missing blocks of a GPT-2 with " + cfg.to_string() + ": it has " +
                             std::to_string(cfg.layers) + " blocks, the file " + std::to_string(block_indices.size()) +
                             "; the first missing is h." + std::to_string(first_missing) + ": " + list_names(names));
  }
  std::vector<ParamSpec> specs = parameter_specs(cfg);
  std::vector<std::string> missing;
  std::vector<const SafetensorsEntry*> found;
  for (const ParamSpec& s : specs) {
    auto it = by_name.find(strip_prefix(s.name));
    if (it == by_name.end()) {
      missing.push_back(std::string(strip_prefix(s.name)));
      found.push_back(nullptr);
      continue;
    }
    found.push_back(it->second);
    by_name.erase(it);
  }
  if (!missing.empty())
    return Status::not_found(where + ": missing " + std::to_string(missing.size()) + " tensor(s) of a GPT-2 with " +
                             cfg.to_string() + ": " + list_names(missing));
  if (!by_name.empty()) {
    std::vector<std::string> extra;
    for (const auto& [n, e] : by_name) extra.push_back(n);
    return Status::invalid_argument(where + ": " + std::to_string(extra.size()) +
                                    " unexpected tensor(s) for a GPT-2 with " + cfg.to_string() + ": " +
                                    list_names(extra));
  }
  for (size_t p = 0; p < specs.size(); ++p) {
    const SafetensorsEntry& e = *found[p];
    std::vector<int64_t> want = hf_shape(specs[p]);
    if (e.shape != want)
      return Status::invalid_argument(where + ": tensor '" + e.name + "' has shape " + shape_text(e.shape) +
                                      "; expected " + shape_text(want) +
                                      (specs[p].conv1d ? " (Hugging Face Conv1D layout [in, out])" : ""));
    if (e.dtype != "F32" && e.dtype != "F16" && e.dtype != "BF16")
      return Status::invalid_argument(where + ": tensor '" + e.name + "' has dtype " + e.dtype +
                                      "; expected F32, F16 or BF16");
  }
  return found;
}

// "element 37 (index [4, 5] of [8, 24])": a flat index in stored order and its coordinates.
std::string element_text(const SafetensorsEntry& e, size_t flat) {
  std::vector<int64_t> idx(e.shape.size());
  size_t rem = flat;
  for (size_t d = e.shape.size(); d-- > 0;) {
    const size_t dim = static_cast<size_t>(e.shape[d]);
    idx[d] = static_cast<int64_t>(rem % dim);
    rem /= dim;
  }
  return "element " + std::to_string(flat) + " (index " + shape_text(idx) + " of " + shape_text(e.shape) + ")";
}

}  // namespace

std::string StatedModelSizes::describe(size_t field) const {
  const std::string text = keys[field] + " " + std::to_string(size_field(sizes, field));
  return source.empty() ? text : text + " (" + source + ")";
}

std::string hf_config_path(const std::string& weights_path) {
  return (std::filesystem::path(weights_path).parent_path() / "config.json").string();
}

Result<StatedModelSizes> read_hf_gpt2_config(const std::string& path) {
  auto bad = [&](const std::string& what) { return Status::invalid_argument("config file " + path + ": " + what); };
  int raw_fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (raw_fd < 0) {
    int err = errno;
    if (err == ENOENT) return Status::not_found("config file " + path + ": no such file");
    return errno_status("open " + path, err);
  }
  Fd fd(raw_fd);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return errno_status("fstat " + path, errno);
  if (!S_ISREG(st.st_mode)) return bad("not a regular file");
  if (static_cast<uint64_t>(st.st_size) > kMaxConfigBytes)
    return bad(std::to_string(st.st_size) + " bytes, more than the " + std::to_string(kMaxConfigBytes) +
               "-byte limit for a model configuration");
  std::string text(static_cast<size_t>(st.st_size), '\0');
  SPILLWAY_RETURN_IF_ERROR(pread_all(fd.get(), path, text.data(), text.size(), 0));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::corrupt("config file " + path + ": not valid JSON");
  if (!j.is_object()) return bad("not a JSON object");
  if (j.contains("model_type")) {
    if (!j["model_type"].is_string()) return bad("key \"model_type\" is not a string");
    const std::string type = j["model_type"].get<std::string>();
    if (type != "gpt2")
      return bad("model_type is \"" + type + "\"; only GPT-2 checkpoints (model_type \"gpt2\") can be loaded");
  }
  StatedModelSizes s;
  s.source = path;
  // n_positions is the rows of wpe; n_ctx, its older name, counts only without it.
  s.keys = {"n_layer", "n_embd", "n_head", j.contains("n_positions") ? "n_positions" : "n_ctx", "vocab_size"};
  for (size_t i = 0; i < s.keys.size(); ++i) {
    if (!j.contains(s.keys[i])) continue;
    const nlohmann::json& v = j[s.keys[i]];
    if (!v.is_number_integer())
      return bad("key \"" + s.keys[i] + "\" is " + v.dump() + " (" + v.type_name() + "); expected a positive integer");
    const bool in_range = v.is_number_unsigned() && v.get<uint64_t>() >= 1 &&
                          v.get<uint64_t>() <= static_cast<uint64_t>(kMaxModelDim);
    if (!in_range)
      return bad("key \"" + s.keys[i] + "\" is " + v.dump() + "; expected a positive integer up to 2^24 = " +
                 std::to_string(kMaxModelDim));
    size_field(s.sizes, i) = static_cast<int>(v.get<uint64_t>());
  }
  return s;
}

Result<ModelConfig> infer_gpt_config(const SafetensorsReader& file, const StatedModelSizes& flags) {
  auto fail = [&](const std::string& what) {
    return Status::invalid_argument("safetensors file " + file.path() + ": " + what);
  };
  const SafetensorsEntry* wte = nullptr;
  const SafetensorsEntry* wpe = nullptr;
  for (const SafetensorsEntry& e : file.entries()) {
    std::string_view n = strip_prefix(e.name);
    if (n == "wte.weight") wte = &e;
    if (n == "wpe.weight") wpe = &e;
  }
  if (!wte) return fail("no tensor wte.weight (or transformer.wte.weight): not a GPT-2 checkpoint");
  if (!wpe) return fail("no tensor wpe.weight (or transformer.wpe.weight): not a GPT-2 checkpoint");
  if (wte->shape.size() != 2) return fail("wte.weight has shape " + shape_text(wte->shape) + "; expected [vocab, width]");
  if (wpe->shape.size() != 2 || wpe->shape[1] != wte->shape[1])
    return fail("wpe.weight has shape " + shape_text(wpe->shape) + "; expected [context, " +
                std::to_string(wte->shape[1]) + "]");
  for (int64_t d : {wte->shape[0], wte->shape[1], wpe->shape[0]})
    if (d < 1 || d > kMaxModelDim)
      return fail("wte.weight " + shape_text(wte->shape) + " and wpe.weight " + shape_text(wpe->shape) +
                  ": each size must be 1 to 2^24 = " + std::to_string(kMaxModelDim));
  SPILLWAY_ASSIGN_OR_RETURN(const int layers, gpt2_block_count(file));

  // Every block needs its bytes in the file, at 2 bytes a value at the least.
  const int64_t C = wte->shape[1];
  const uint64_t data_bytes = file.entries().empty() ? 0 : file.entries().back().end;
  int64_t block_values = 0, min_bytes = 0;
  if (__builtin_mul_overflow(12 * C, C, &block_values) || __builtin_add_overflow(block_values, 13 * C, &block_values) ||
      __builtin_mul_overflow(block_values, int64_t{2} * layers, &min_bytes) ||
      static_cast<uint64_t>(min_bytes) > data_bytes)
    return fail(std::to_string(layers) + " block(s) of width " + std::to_string(C) + " need at least " +
                std::to_string(block_values) + " values each (" +
                (min_bytes > 0 ? std::to_string(min_bytes) + " bytes in all" : std::string("more than 2^63 bytes")) +
                " at 2 bytes a value), but the file's data is " + std::to_string(data_bytes) + " bytes");

  // Sizes from the weights; heads from config.json, __metadata__ or the flags. Every
  // stated size must agree with the weights and with the other sources.
  ModelConfig cfg{layers, static_cast<int>(C), 0, static_cast<int>(wpe->shape[0]), static_cast<int>(wte->shape[0])};
  std::array<std::string, 5> chosen = {
      "the weights: " + std::to_string(layers) + " block(s), h.0 … h." + std::to_string(layers - 1),
      "the weights: width " + std::to_string(cfg.width) + " (wte.weight " + shape_text(wte->shape) + ")",
      "",
      "the weights: context " + std::to_string(cfg.context) + " (wpe.weight " + shape_text(wpe->shape) + ")",
      "the weights: vocab " + std::to_string(cfg.vocab) + " (wte.weight " + shape_text(wte->shape) + ")"};
  std::vector<StatedModelSizes> sources;
  const std::string config_path = hf_config_path(file.path());
  auto config = read_hf_gpt2_config(config_path);
  const bool have_config = config.ok();
  if (have_config) sources.push_back(*config);
  else if (config.status().code() != StatusCode::NotFound) return config.status();
  SPILLWAY_ASSIGN_OR_RETURN(StatedModelSizes meta, metadata_sizes(file));
  sources.push_back(std::move(meta));
  sources.push_back(flags);
  for (const StatedModelSizes& s : sources) {
    for (size_t i = 0; i < kSizeNames.size(); ++i) {
      const int v = size_field(s.sizes, i);
      if (v == 0) continue;
      if (v < 0) return fail(std::string("model ") + kSizeNames[i] + ": " + s.describe(i) + " must be positive");
      int& field = size_field(cfg, i);
      if (field == 0) {
        field = v;
        chosen[i] = s.describe(i);
      } else if (field != v) {
        return fail(std::string("model ") + kSizeNames[i] + ": " + s.describe(i) + " disagrees with " + chosen[i]);
      }
    }
  }
  if (cfg.heads == 0)
    return fail("the number of attention heads is stated nowhere: the file's __metadata__ has no n_head, and " +
                (have_config ? config_path + " has no n_head" : "there is no config.json beside it (" + config_path + ")") +
                "; pass --heads (width " + std::to_string(cfg.width) + " = heads x head size)");
  SPILLWAY_RETURN_IF_ERROR(cfg.validate().with_context("safetensors file " + file.path()));
  SPILLWAY_RETURN_IF_ERROR(match_gpt2(file, cfg).status());
  return cfg;
}

Result<ModelConfig> infer_gpt_config(const std::string& path, const StatedModelSizes& flags) {
  SPILLWAY_ASSIGN_OR_RETURN(SafetensorsReader f, SafetensorsReader::open(path));
  return infer_gpt_config(f, flags);
}

Status import_gpt2(const std::string& path, const ModelConfig& cfg,
                   const std::function<Status(const ParamSpec&, std::vector<float>&&)>& sink,
                   const ImportOptions& options) {
  SPILLWAY_RETURN_IF_ERROR(cfg.validate());
  SPILLWAY_ASSIGN_OR_RETURN(SafetensorsReader file, SafetensorsReader::open(path));
  SPILLWAY_ASSIGN_OR_RETURN(std::vector<const SafetensorsEntry*> found, match_gpt2(file, cfg));
  std::vector<ParamSpec> specs = parameter_specs(cfg);
  for (size_t p = 0; p < specs.size(); ++p) {
    const SafetensorsEntry& e = *found[p];
    SPILLWAY_ASSIGN_OR_RETURN(std::vector<float> v, file.read_f32(e));
    if (!options.allow_nonfinite) {
      // By the bits, so that no compiler flag can fold the test away.
      auto bad = std::find_if(v.begin(), v.end(), [](float x) {
        return (std::bit_cast<uint32_t>(x) & 0x7f800000u) == 0x7f800000u;
      });
      if (bad != v.end()) {
        const uint32_t bits = std::bit_cast<uint32_t>(*bad);
        const char* what = (bits & 0x7fffffu) ? "NaN" : (bits >> 31) ? "-Inf" : "+Inf";
        return Status::invalid_argument("safetensors file " + path + ": tensor '" + e.name + "' " +
                                        element_text(e, static_cast<size_t>(bad - v.begin())) + " is " + what +
                                        "; weights must be finite (--allow-nonfinite-weights loads them anyway)");
      }
    }
    if (specs[p].conv1d) v = transpose(v, specs[p].shape[1], specs[p].shape[0]);
    SPILLWAY_RETURN_IF_ERROR(sink(specs[p], std::move(v)));
  }
  return Status::ok();
}

Result<GPTWeights> import_gpt2(const std::string& path, const ModelConfig& cfg, const ImportOptions& options) {
  GPTWeights w;
  SPILLWAY_RETURN_IF_ERROR(import_gpt2(
      path, cfg,
      [&](const ParamSpec& s, std::vector<float>&& v) {
        w.emplace(s.name, std::move(v));
        return Status::ok();
      },
      options));
  return w;
}

Status export_gpt2(const std::string& path, const ModelConfig& cfg,
                   const std::function<Result<std::vector<float>>(const ParamSpec&)>& source) {
  SPILLWAY_RETURN_IF_ERROR(cfg.validate());
  std::vector<SafetensorsTensor> tensors;
  for (const ParamSpec& s : parameter_specs(cfg)) {
    SafetensorsTensor t;
    t.name = s.name;
    t.shape = hf_shape(s);
    t.values = [&source, s]() -> Result<std::vector<float>> {
      SPILLWAY_ASSIGN_OR_RETURN(std::vector<float> v, source(s));
      if (static_cast<int64_t>(v.size()) != s.shape.numel())
        return Status::invalid_argument("parameter '" + s.name + "' has " +
                                        std::to_string(v.size()) + " values; shape " + s.shape.to_string() +
                                        " needs " + std::to_string(s.shape.numel()));
      if (s.conv1d) return transpose(v, s.shape[0], s.shape[1]);
      return v;
    };
    tensors.push_back(std::move(t));
  }
  std::map<std::string, std::string> meta = {{"format", "pt"},
                                             {"n_layer", std::to_string(cfg.layers)},
                                             {"n_embd", std::to_string(cfg.width)},
                                             {"n_head", std::to_string(cfg.heads)},
                                             {"n_ctx", std::to_string(cfg.context)},
                                             {"vocab_size", std::to_string(cfg.vocab)}};
  return write_safetensors(path, tensors, meta);
}

Status export_gpt2(const std::string& path, const ModelConfig& cfg, const GPTWeights& weights) {
  return export_gpt2(path, cfg, [&](const ParamSpec& s) -> Result<std::vector<float>> {
    auto it = weights.find(s.name);
    if (it == weights.end())
      return Status::not_found("no values for parameter '" + s.name + "'");
    return it->second;
  });
}

}  // namespace spillway
