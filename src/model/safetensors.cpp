#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

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

// "h.3.ln_1.weight" → 3 (and the rest after "h.3."); -1 when not a block name.
int block_index(std::string_view name, std::string_view* rest) {
  if (name.substr(0, 2) != "h.") return -1;
  size_t i = 2;
  int v = 0;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9' && i < 9) v = v * 10 + (name[i++] - '0');
  if (i == 2 || i >= name.size() || name[i] != '.') return -1;
  if (rest) *rest = name.substr(i + 1);
  return v;
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

// The header length, the header text and each tensor's values, into a new file.
Status write_file(const std::string& tmp, const std::string& text, const std::vector<SafetensorsTensor>& tensors) {
  int raw_fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (raw_fd < 0) return errno_status("open " + tmp + " for writing", errno);
  Fd fd(raw_fd);
  uint8_t len_bytes[8];
  uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<uint8_t>(len >> (8 * i));
  uint64_t pos = 0;
  SPILLWAY_RETURN_IF_ERROR(write_all(fd.get(), tmp, len_bytes, 8, pos));
  pos += 8;
  SPILLWAY_RETURN_IF_ERROR(write_all(fd.get(), tmp, text.data(), text.size(), pos));
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
    SPILLWAY_RETURN_IF_ERROR(write_all(fd.get(), tmp, values.data(), values.size() * 4, pos));
    pos += values.size() * 4;
  }
  if (::fsync(fd.get()) != 0) return errno_status("fsync " + tmp, errno);
  return fd.close(tmp);
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

  const std::string tmp = path + ".tmp";
  Status s = write_file(tmp, text, tensors);
  if (!s.is_ok()) {
    ::unlink(tmp.c_str());
    return s.with_context("safetensors file " + path);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    Status err = errno_status("rename " + tmp + " to " + path, errno);
    ::unlink(tmp.c_str());
    return err;
  }
  return Status::ok();
}


// ---------------------------------------------------------------- GPT-2

Result<GPTConfig> infer_gpt_config(const SafetensorsReader& file) {
  auto fail = [&](const std::string& what) {
    return Status::invalid_argument("safetensors file " + file.path() + ": " + what);
  };
  const SafetensorsEntry* wte = nullptr;
  const SafetensorsEntry* wpe = nullptr;
  int layers = 0;
  for (const SafetensorsEntry& e : file.entries()) {
    std::string_view n = strip_prefix(e.name);
    if (n == "wte.weight") wte = &e;
    if (n == "wpe.weight") wpe = &e;
    int i = block_index(n, nullptr);
    if (i >= 0) layers = std::max(layers, i + 1);
  }
  if (!wte) return fail("no tensor wte.weight (or transformer.wte.weight): not a GPT-2 checkpoint");
  if (!wpe) return fail("no tensor wpe.weight (or transformer.wpe.weight): not a GPT-2 checkpoint");
  if (wte->shape.size() != 2) return fail("wte.weight has shape " + shape_text(wte->shape) + "; expected [vocab, width]");
  if (wpe->shape.size() != 2 || wpe->shape[1] != wte->shape[1])
    return fail("wpe.weight has shape " + shape_text(wpe->shape) + "; expected [context, " +
                std::to_string(wte->shape[1]) + "]");
  GPTConfig cfg;
  cfg.vocab = static_cast<int>(wte->shape[0]);
  cfg.width = static_cast<int>(wte->shape[1]);
  cfg.context = static_cast<int>(wpe->shape[0]);
  cfg.layers = layers;
  auto it = file.metadata().find("n_head");
  if (it != file.metadata().end()) {
    char* end = nullptr;
    long h = std::strtol(it->second.c_str(), &end, 10);
    if (it->second.empty() || *end != '\0' || h <= 0 || h > 1 << 20)
      return fail("__metadata__ n_head '" + it->second + "' is not a positive integer");
    cfg.heads = static_cast<int>(h);
  } else {
    if (cfg.width % 64 != 0)
      return fail("no n_head in __metadata__ and width " + std::to_string(cfg.width) +
                  " is not a multiple of 64 (the default head size)");
    cfg.heads = cfg.width / 64;
  }
  if (layers == 0) return fail("no transformer blocks (h.0.*)");
  SPILLWAY_RETURN_IF_ERROR(cfg.validate().with_context("safetensors file " + file.path()));
  return cfg;
}

Result<GPTConfig> infer_gpt_config(const std::string& path) {
  SPILLWAY_ASSIGN_OR_RETURN(SafetensorsReader f, SafetensorsReader::open(path));
  return infer_gpt_config(f);
}

Status import_gpt2(const std::string& path, const GPTConfig& cfg,
                   const std::function<Status(const ParamSpec&, std::vector<float>&&)>& sink) {
  SPILLWAY_RETURN_IF_ERROR(cfg.validate());
  SPILLWAY_ASSIGN_OR_RETURN(SafetensorsReader file, SafetensorsReader::open(path));
  const std::string where = "safetensors file " + path;
  // Stored tensors by name without the "transformer." prefix.
  std::map<std::string, const SafetensorsEntry*, std::less<>> by_name;
  for (const SafetensorsEntry& e : file.entries()) {
    std::string_view n = strip_prefix(e.name);
    std::string_view rest;
    if (n == "lm_head.weight") continue;  // tied to wte
    if (block_index(n, &rest) >= 0 && (rest == "attn.bias" || rest == "attn.masked_bias")) continue;  // buffers
    if (!by_name.emplace(std::string(n), &e).second)
      return Status::invalid_argument(where + ": tensor '" + std::string(n) +
                                      "' appears twice (with and without the transformer. prefix)");
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
  for (size_t p = 0; p < specs.size(); ++p) {
    SPILLWAY_ASSIGN_OR_RETURN(std::vector<float> v, file.read_f32(*found[p]));
    if (specs[p].conv1d) v = transpose(v, specs[p].shape[1], specs[p].shape[0]);
    SPILLWAY_RETURN_IF_ERROR(sink(specs[p], std::move(v)));
  }
  return Status::ok();
}

Result<GPTWeights> import_gpt2(const std::string& path, const GPTConfig& cfg) {
  GPTWeights w;
  SPILLWAY_RETURN_IF_ERROR(import_gpt2(path, cfg, [&](const ParamSpec& s, std::vector<float>&& v) {
    w.emplace(s.name, std::move(v));
    return Status::ok();
  }));
  return w;
}

Status export_gpt2(const std::string& path, const GPTConfig& cfg,
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

Status export_gpt2(const std::string& path, const GPTConfig& cfg, const GPTWeights& weights) {
  return export_gpt2(path, cfg, [&](const ParamSpec& s) -> Result<std::vector<float>> {
    auto it = weights.find(s.name);
    if (it == weights.end())
      return Status::not_found("no values for parameter '" + s.name + "'");
    return it->second;
  });
}

}  // namespace spillway
