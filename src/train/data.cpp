#include "train/data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>

#include "core/random.h"

namespace spillway {

static_assert(std::endian::native == std::endian::little, "token files are read on a little-endian host");

std::vector<int32_t> byte_encode(std::string_view text) {
  std::vector<int32_t> out(text.size());
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
  return out;
}

std::string byte_decode(const int32_t* tokens, size_t n) {
  std::string s(n, '?');
  for (size_t i = 0; i < n; ++i)
    if (tokens[i] >= 0 && tokens[i] < kByteVocab) s[i] = static_cast<char>(static_cast<unsigned char>(tokens[i]));
  return s;
}

namespace {

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// The whole file. `what` names it in errors ("data file", "validation file").
Result<std::string> read_file(const std::string& path, const std::string& what) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) return Status::not_found(what + " " + path + ": no such file");
    return errno_status("open " + what + " " + path, err);
  }
  std::string data;
  char buf[1 << 16];
  Status status;
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      status = errno_status("read " + what + " " + path + " at offset " + std::to_string(data.size()), errno);
      break;
    }
    if (n == 0) break;
    data.append(buf, static_cast<size_t>(n));
  }
  if (::close(fd) != 0 && status.is_ok()) status = errno_status("close " + what + " " + path, errno);
  if (!status.is_ok()) return status;
  return data;
}

int32_t int_at(const std::string& bytes, size_t index) {
  int32_t v;
  std::memcpy(&v, bytes.data() + index * 4, 4);
  return v;
}

bool has_token_magic(const std::string& bytes) { return bytes.size() >= 4 && int_at(bytes, 0) == kTokenFileMagic; }

// The tokens of a token file already read into `bytes`.
Result<std::vector<uint16_t>> parse_token_file(const std::string& path, const std::string& bytes) {
  auto corrupt = [&](const std::string& what) { return Status::corrupt("token file " + path + ": " + what); };
  if (bytes.empty()) return Status::invalid_argument("token file " + path + ": file is empty");
  if (!has_token_magic(bytes))
    return corrupt("wrong magic " + std::to_string(bytes.size() >= 4 ? int_at(bytes, 0) : 0) + " (an llm.c token file starts with " +
                   std::to_string(kTokenFileMagic) + ")");
  const size_t header_bytes = kTokenFileHeaderInts * 4;
  if (bytes.size() < header_bytes)
    return corrupt("truncated header: file is " + std::to_string(bytes.size()) + " bytes, the header alone is " +
                   std::to_string(header_bytes));
  int32_t version = int_at(bytes, 1);
  if (version != kTokenFileVersion)
    return corrupt("version " + std::to_string(version) + ", expected " + std::to_string(kTokenFileVersion));
  int32_t count = int_at(bytes, 2);
  if (count < 0) return corrupt("negative token count " + std::to_string(count));
  if (count == 0) return Status::invalid_argument("token file " + path + ": holds no tokens (count 0)");
  size_t present = (bytes.size() - header_bytes) / 2;
  if (static_cast<size_t>(count) > present)
    return corrupt("truncated: the header counts " + std::to_string(count) + " tokens but the file holds " +
                   std::to_string(present));
  std::vector<uint16_t> tokens(static_cast<size_t>(count));
  std::memcpy(tokens.data(), bytes.data() + header_bytes, tokens.size() * 2);
  return tokens;
}

// Text or token file, by the magic. `text` tells which it was.
Result<std::vector<uint16_t>> load_tokens(const std::string& path, const std::string& what, bool* text) {
  SPILLWAY_ASSIGN_OR_RETURN(std::string bytes, read_file(path, what));
  if (bytes.empty()) return Status::invalid_argument(what + " " + path + ": file is empty");
  if (has_token_magic(bytes) || std::string_view(path).ends_with(".bin")) {
    *text = false;
    return parse_token_file(path, bytes);
  }
  *text = true;
  std::vector<uint16_t> tokens(bytes.size());
  for (size_t i = 0; i < bytes.size(); ++i) tokens[i] = static_cast<unsigned char>(bytes[i]);
  return tokens;
}

Status check_vocab(const std::string& path, const std::vector<uint16_t>& tokens, int vocab, bool text) {
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] >= vocab)
      return Status::invalid_argument((text ? "text file " : "token file ") + path + ": " +
                                      (text ? "byte " : "token ") + std::to_string(tokens[i]) + " at position " +
                                      std::to_string(i) + " is not below the model's vocabulary size " +
                                      std::to_string(vocab));
  return Status::ok();
}

TokenSplit make_split(std::string source, std::vector<uint16_t> tokens) {
  return {std::move(source), std::make_shared<const std::vector<uint16_t>>(std::move(tokens))};
}

}  // namespace

Result<std::vector<uint16_t>> read_token_file(const std::string& path) {
  SPILLWAY_ASSIGN_OR_RETURN(std::string bytes, read_file(path, "token file"));
  return parse_token_file(path, bytes);
}

Status write_token_file(const std::string& path, const std::vector<uint16_t>& tokens) {
  if (tokens.size() > static_cast<size_t>(INT32_MAX))
    return Status::invalid_argument("token file " + path + ": " + std::to_string(tokens.size()) +
                                    " tokens do not fit the int32 count of the header");
  std::vector<int32_t> header(kTokenFileHeaderInts, 0);
  header[0] = kTokenFileMagic;
  header[1] = kTokenFileVersion;
  header[2] = static_cast<int32_t>(tokens.size());
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return errno_status("open token file " + path + " for writing", errno);
  auto write_all = [&](const void* data, size_t bytes, size_t offset) -> Status {
    const char* p = static_cast<const char*>(data);
    size_t done = 0;
    while (done < bytes) {
      ssize_t n = ::write(fd, p + done, bytes - done);
      if (n < 0) {
        if (errno == EINTR) continue;
        return errno_status("write token file " + path + " at offset " + std::to_string(offset + done), errno);
      }
      done += static_cast<size_t>(n);
    }
    return Status::ok();
  };
  Status s = write_all(header.data(), header.size() * 4, 0);
  if (s.is_ok()) s = write_all(tokens.data(), tokens.size() * 2, header.size() * 4);
  if (::close(fd) != 0 && s.is_ok()) s = errno_status("close token file " + path, errno);
  return s;
}

Result<Dataset> load_dataset(const std::string& path, int vocab, const std::string& val_path) {
  if (vocab <= 0 || vocab > 65536)
    return Status::invalid_argument("vocabulary size " + std::to_string(vocab) + " is not in 1..65536");
  Dataset d;
  SPILLWAY_ASSIGN_OR_RETURN(std::vector<uint16_t> tokens, load_tokens(path, "data file", &d.text));
  SPILLWAY_RETURN_IF_ERROR(check_vocab(path, tokens, vocab, d.text));

  std::string val_file = val_path;
  if (val_file.empty() && !d.text && std::string_view(path).ends_with("_train.bin")) {
    std::string sibling = path.substr(0, path.size() - std::string_view("_train.bin").size()) + "_val.bin";
    if (file_exists(sibling)) val_file = sibling;
  }
  if (!val_file.empty()) {
    bool val_text = false;
    SPILLWAY_ASSIGN_OR_RETURN(std::vector<uint16_t> val, load_tokens(val_file, "validation file", &val_text));
    SPILLWAY_RETURN_IF_ERROR(check_vocab(val_file, val, vocab, val_text));
    d.train = make_split(path, std::move(tokens));
    d.val = make_split(val_file, std::move(val));
    return d;
  }
  size_t n_val = tokens.size() / 10;
  size_t n_train = tokens.size() - n_val;
  std::vector<uint16_t> val(tokens.begin() + static_cast<ptrdiff_t>(n_train), tokens.end());
  tokens.resize(n_train);
  d.train = make_split(path + " (first 90%, training)", std::move(tokens));
  d.val = make_split(path + " (last 10%, validation)", std::move(val));
  return d;
}

Result<DataLoader> DataLoader::create(const TokenSplit& split, int B, int T, LoaderMode mode, uint64_t seed) {
  if (B <= 0 || T <= 0)
    return Status::invalid_argument("data loader for " + split.source + ": B = " + std::to_string(B) +
                                    " and T = " + std::to_string(T) + " must be positive");
  if (split.size() < static_cast<size_t>(T) + 1)
    return Status::invalid_argument(split.source + ": has " + std::to_string(split.size()) +
                                    " tokens; a sequence of T = " + std::to_string(T) + " needs at least T+1 = " +
                                    std::to_string(T + 1));
  DataLoader l;
  l.tokens_ = split.tokens;
  l.B_ = B;
  l.T_ = T;
  l.mode_ = mode;
  l.key_ = splitmix64_mix(seed);
  return l;
}

int64_t DataLoader::row_start(int64_t batch, int row) const {
  const uint64_t n = tokens_->size();
  const uint64_t window = static_cast<uint64_t>(batch) * static_cast<uint64_t>(B_) + static_cast<uint64_t>(row);
  if (mode_ == LoaderMode::Random) {
    uint64_t r = splitmix64_mix(key_ + (window + 1) * kSplitMixGolden);
    unsigned __int128 scaled = static_cast<unsigned __int128>(r) * (n - static_cast<uint64_t>(T_));
    return static_cast<int64_t>(scaled >> 64);
  }
  const uint64_t windows = (n - 1) / static_cast<uint64_t>(T_);
  return static_cast<int64_t>((window % windows) * static_cast<uint64_t>(T_));
}

void DataLoader::next(int32_t* tokens, int32_t* targets) {
  const std::vector<uint16_t>& data = *tokens_;
  for (int b = 0; b < B_; ++b) {
    const size_t start = static_cast<size_t>(row_start(batch_, b));
    for (int t = 0; t < T_; ++t) {
      tokens[static_cast<size_t>(b) * T_ + t] = data[start + t];
      targets[static_cast<size_t>(b) * T_ + t] = data[start + t + 1];
    }
  }
  ++batch_;
}

int64_t DataLoader::batches_per_epoch() const {
  const int64_t n = static_cast<int64_t>(tokens_->size());
  if (mode_ == LoaderMode::Random) return std::max<int64_t>(1, (n - 1) / (int64_t{B_} * T_));
  return std::max<int64_t>(1, ((n - 1) / T_) / B_);
}

}  // namespace spillway
