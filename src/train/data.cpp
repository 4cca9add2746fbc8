#include "train/data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>

#include "core/atomic_file.h"
#include "core/input_file.h"
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

// Bytes of a file mapping or of memory, and what keeps them alive.
struct Bytes {
  std::shared_ptr<const void> owner;
  const char* data = nullptr;  // [size]
  size_t size = 0;
  std::string_view view() const { return {data, size}; }
};

// The whole file, mapped read-only. `what` names it in errors ("data file",
// "validation file"). Only regular files: a device or a pipe has no size and would
// be read without end.
Result<Bytes> map_file(const std::string& path, const std::string& what) {
  // open_regular_file: a FIFO is refused without waiting for a writer.
  struct stat st {};
  auto opened = open_regular_file(path, what, &st);
  if (!opened.ok()) {
    const Status& e = opened.status();
    return e.code() == StatusCode::InvalidArgument ? Status::invalid_argument(e.message() + " of text or llm.c tokens")
                                                   : e;
  }
  const int fd = *opened;
  auto close_with = [&](Status status) -> Status {
    if (::close(fd) != 0 && status.is_ok()) return errno_status("close " + what + " " + path, errno);
    return status;
  };
  if (st.st_size == 0) return close_with(Status::invalid_argument(what + " " + path + ": file is empty"));
  const size_t size = static_cast<size_t>(st.st_size);
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (p == MAP_FAILED)
    return close_with(errno_status("mmap " + what + " " + path + " (" + std::to_string(size) + " bytes)", errno));
  Bytes b;
  // munmap fails only on arguments mmap returned; nothing to report it to here.
  b.owner = std::shared_ptr<const void>(p, [size](const void* q) { ::munmap(const_cast<void*>(q), size); });
  b.data = static_cast<const char*>(p);
  b.size = size;
  SPILLWAY_RETURN_IF_ERROR(close_with(Status::ok()));
  return b;
}

int32_t int_at(std::string_view bytes, size_t index) {
  int32_t v;
  std::memcpy(&v, bytes.data() + index * 4, 4);
  return v;
}

bool has_token_magic(std::string_view bytes) { return bytes.size() >= 4 && int_at(bytes, 0) == kTokenFileMagic; }

// The tokens of a token file whose bytes are `b`, in place (sharing b's owner).
Result<TokenSpan> parse_token_file(const std::string& path, const Bytes& b) {
  const std::string_view bytes = b.view();
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
  if (version != kTokenFileVersion && version != kTokenFileVersion32)
    return corrupt("version " + std::to_string(version) + ", expected " + std::to_string(kTokenFileVersion) +
                   " (uint16 tokens) or " + std::to_string(kTokenFileVersion32) + " (uint32 tokens)");
  const size_t width = version == kTokenFileVersion ? 2 : 4;
  int32_t count = int_at(bytes, 2);
  if (count < 0) return corrupt("negative token count " + std::to_string(count));
  if (count == 0) return Status::invalid_argument("token file " + path + ": holds no tokens (count 0)");
  const size_t body = bytes.size() - header_bytes;
  const size_t expected = static_cast<size_t>(count) * width;
  if (expected > body)
    return corrupt("truncated: the header counts " + std::to_string(count) + " tokens but the file holds " +
                   std::to_string(body / width) + (width == 4 ? " (version 2: 4 bytes a token)" : ""));
  if (expected < body)
    return corrupt("the header counts " + std::to_string(count) + " tokens (" + std::to_string(expected) +
                   " bytes) but " + std::to_string(body) + " bytes follow the header (" +
                   std::to_string(header_bytes + expected) + " bytes expected in all, the file has " +
                   std::to_string(bytes.size()) + ")");
  // Tokens start at byte 1024 of a page-aligned mapping (or of a uint32 vector): 4-aligned.
  if (width == 4)
    return TokenSpan(b.owner, reinterpret_cast<const uint32_t*>(b.data + header_bytes), static_cast<size_t>(count));
  return TokenSpan(b.owner, reinterpret_cast<const uint16_t*>(b.data + header_bytes), static_cast<size_t>(count));
}

// Text or token file bytes, by the magic (or a ".bin" name). `text` tells which.
Result<TokenSpan> tokens_of(const std::string& name, const Bytes& b, bool* text) {
  if (has_token_magic(b.view()) || std::string_view(name).ends_with(".bin")) {
    *text = false;
    return parse_token_file(name, b);
  }
  *text = true;
  auto tokens = std::make_shared<std::vector<uint16_t>>(b.size);
  for (size_t i = 0; i < b.size; ++i) (*tokens)[i] = static_cast<unsigned char>(b.data[i]);
  return TokenSpan(std::shared_ptr<const std::vector<uint16_t>>(std::move(tokens)));
}

Result<TokenSpan> load_tokens(const std::string& path, const std::string& what, bool* text) {
  SPILLWAY_ASSIGN_OR_RETURN(Bytes bytes, map_file(path, what));
  return tokens_of(path, bytes, text);
}

Status check_vocab(const std::string& path, const TokenSpan& tokens, int vocab, bool text) {
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] >= static_cast<uint32_t>(vocab))
      return Status::invalid_argument((text ? "text file " : "token file ") + path + ": " +
                                      (text ? "byte " : "token ") + std::to_string(tokens[i]) + " at position " +
                                      std::to_string(i) + " is not below the model's vocabulary size " +
                                      std::to_string(vocab));
  return Status::ok();
}

Status check_vocab_size(int vocab) {
  if (vocab <= 0) return Status::invalid_argument("vocabulary size " + std::to_string(vocab) + " is not positive");
  return Status::ok();
}

// The first 90% for training, the last 10% for validation, sharing the tokens.
void split_ninety_ten(Dataset& d, const std::string& name, const TokenSpan& tokens) {
  const size_t n_val = tokens.size() / 10;
  const size_t n_train = tokens.size() - n_val;
  d.train = {name + " (first 90%, training)", tokens.subspan(0, n_train)};
  d.val = {name + " (last 10%, validation)", tokens.subspan(n_train, n_val)};
}

}  // namespace

Result<MappedBytes> map_data_file(const std::string& path, const std::string& what) {
  SPILLWAY_ASSIGN_OR_RETURN(Bytes b, map_file(path, what));
  return MappedBytes{b.owner, b.view()};
}

bool is_token_file(std::string_view bytes) { return has_token_magic(bytes); }

Result<std::vector<uint32_t>> read_token_file(const std::string& path) {
  SPILLWAY_ASSIGN_OR_RETURN(Bytes bytes, map_file(path, "token file"));
  SPILLWAY_ASSIGN_OR_RETURN(TokenSpan tokens, parse_token_file(path, bytes));
  return std::vector<uint32_t>(tokens.begin(), tokens.end());
}

namespace {

// Writes the header and `n` tokens of `width` bytes at `data`.
Status write_tokens(const std::string& path, const void* data, size_t n, int width) {
  if (n > static_cast<size_t>(INT32_MAX))
    return Status::invalid_argument("token file " + path + ": " + std::to_string(n) +
                                    " tokens do not fit the int32 count of the header");
  std::vector<int32_t> header(kTokenFileHeaderInts, 0);
  header[0] = kTokenFileMagic;
  header[1] = width == 2 ? kTokenFileVersion : kTokenFileVersion32;
  header[2] = static_cast<int32_t>(n);
  // Whole or not at all: a temporary file beside `path`, renamed onto it when
  // complete (so the input of `spillway tokenize` may be its output too).
  SPILLWAY_ASSIGN_OR_RETURN(AtomicFile file, AtomicFile::create(path));
  auto write_all = [&](const void* bytes_at, size_t bytes, size_t offset) -> Status {
    const char* p = static_cast<const char*>(bytes_at);
    size_t done = 0;
    while (done < bytes) {
      ssize_t w = ::write(file.fd(), p + done, bytes - done);
      if (w < 0) {
        if (errno == EINTR) continue;
        return errno_status("write token file " + file.temp_path() + " at offset " + std::to_string(offset + done),
                            errno);
      }
      done += static_cast<size_t>(w);
    }
    return Status::ok();
  };
  SPILLWAY_RETURN_IF_ERROR(write_all(header.data(), header.size() * 4, 0));
  SPILLWAY_RETURN_IF_ERROR(write_all(data, n * static_cast<size_t>(width), header.size() * 4));
  return file.commit();
}

Status check_tokens(const std::string& what, const uint32_t* tokens, size_t n, int64_t vocab) {
  for (size_t i = 0; i < n; ++i)
    if (tokens[i] >= vocab)
      return Status::invalid_argument(what + ": token " + std::to_string(tokens[i]) + " at position " +
                                      std::to_string(i) + " is not below the vocabulary size " + std::to_string(vocab));
  return Status::ok();
}

}  // namespace

Status write_token_file(const std::string& path, const std::vector<uint16_t>& tokens) {
  return write_tokens(path, tokens.data(), tokens.size(), 2);
}

Status write_token_file(const std::string& path, const uint32_t* tokens, size_t n, int64_t vocab) {
  if (vocab <= 0 || vocab > UINT32_MAX)
    return Status::invalid_argument("token file " + path + ": vocabulary size " + std::to_string(vocab) +
                                    " is not in 1..4294967295");
  SPILLWAY_RETURN_IF_ERROR(check_tokens("token file " + path, tokens, n, vocab));
  if (vocab > kTokenFile16Vocab) return write_tokens(path, tokens, n, 4);
  std::vector<uint16_t> narrow(tokens, tokens + n);
  return write_tokens(path, narrow.data(), n, 2);
}

Result<Dataset> load_dataset(const std::string& path, int vocab, const std::string& val_path) {
  SPILLWAY_RETURN_IF_ERROR(check_vocab_size(vocab));
  Dataset d;
  SPILLWAY_ASSIGN_OR_RETURN(TokenSpan tokens, load_tokens(path, "data file", &d.text));
  SPILLWAY_RETURN_IF_ERROR(check_vocab(path, tokens, vocab, d.text));

  std::string val_file = val_path;
  if (val_file.empty() && !d.text && std::string_view(path).ends_with("_train.bin")) {
    std::string sibling = path.substr(0, path.size() - std::string_view("_train.bin").size()) + "_val.bin";
    if (file_exists(sibling)) val_file = sibling;
  }
  if (!val_file.empty()) {
    bool val_text = false;
    SPILLWAY_ASSIGN_OR_RETURN(TokenSpan val, load_tokens(val_file, "validation file", &val_text));
    SPILLWAY_RETURN_IF_ERROR(check_vocab(val_file, val, vocab, val_text));
    d.train = {path, std::move(tokens)};
    d.val = {val_file, std::move(val)};
    return d;
  }
  split_ninety_ten(d, path, tokens);
  return d;
}

Result<Dataset> load_dataset_from_memory(std::string_view bytes, const std::string& name, int vocab) {
  SPILLWAY_RETURN_IF_ERROR(check_vocab_size(vocab));
  if (bytes.empty()) return Status::invalid_argument(name + ": holds no bytes");
  // A copy, 4-aligned for the tokens of a token file.
  auto copy = std::make_shared<std::vector<uint32_t>>((bytes.size() + 3) / 4);
  std::memcpy(copy->data(), bytes.data(), bytes.size());
  Bytes b{copy, reinterpret_cast<const char*>(copy->data()), bytes.size()};
  Dataset d;
  SPILLWAY_ASSIGN_OR_RETURN(TokenSpan tokens, tokens_of(name, b, &d.text));
  SPILLWAY_RETURN_IF_ERROR(check_vocab(name, tokens, vocab, d.text));
  split_ninety_ten(d, name, tokens);
  return d;
}

Result<Dataset> dataset_from_tokens(const std::vector<uint32_t>& tokens, const std::string& name, int vocab) {
  SPILLWAY_RETURN_IF_ERROR(check_vocab_size(vocab));
  if (tokens.empty()) return Status::invalid_argument(name + ": holds no tokens");
  SPILLWAY_RETURN_IF_ERROR(check_tokens(name, tokens.data(), tokens.size(), vocab));
  Dataset d;
  if (vocab <= kTokenFile16Vocab) {
    split_ninety_ten(d, name, TokenSpan(std::make_shared<const std::vector<uint16_t>>(tokens.begin(), tokens.end())));
  } else {
    split_ninety_ten(d, name, TokenSpan(std::make_shared<const std::vector<uint32_t>>(tokens)));
  }
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
  const uint64_t n = tokens_.size();
  const uint64_t window = static_cast<uint64_t>(batch) * static_cast<uint64_t>(B_) + static_cast<uint64_t>(row);
  if (mode_ == LoaderMode::Random) {
    uint64_t r = splitmix64_mix(key_ + (window + 1) * kSplitMixGolden);
    unsigned __int128 scaled = static_cast<unsigned __int128>(r) * (n - static_cast<uint64_t>(T_));
    return static_cast<int64_t>(scaled >> 64);
  }
  const uint64_t windows = (n - 1) / static_cast<uint64_t>(T_);
  return static_cast<int64_t>((window % windows) * static_cast<uint64_t>(T_));
}

namespace {
template <typename Token>
void fill_rows(const Token* data, const DataLoader& l, int64_t batch, int B, int T, int32_t* tokens,
               int32_t* targets, int64_t (DataLoader::*row_start)(int64_t, int) const) {
  for (int b = 0; b < B; ++b) {
    const size_t start = static_cast<size_t>((l.*row_start)(batch, b));
    for (int t = 0; t < T; ++t) {
      tokens[static_cast<size_t>(b) * T + t] = static_cast<int32_t>(data[start + t]);
      targets[static_cast<size_t>(b) * T + t] = static_cast<int32_t>(data[start + t + 1]);
    }
  }
}
}  // namespace

void DataLoader::next(int32_t* tokens, int32_t* targets) {
  // Tokens were checked below the vocabulary (an int) when loaded: they fit int32.
  if (tokens_.bytes_per_token() == 2)
    fill_rows(static_cast<const uint16_t*>(tokens_.raw()), *this, batch_, B_, T_, tokens, targets, &DataLoader::row_start);
  else
    fill_rows(static_cast<const uint32_t*>(tokens_.raw()), *this, batch_, B_, T_, tokens, targets, &DataLoader::row_start);
  ++batch_;
}

int64_t DataLoader::batches_per_epoch() const {
  const int64_t n = static_cast<int64_t>(tokens_.size());
  if (mode_ == LoaderMode::Random) return std::max<int64_t>(1, (n - 1) / (int64_t{B_} * T_));
  return std::max<int64_t>(1, ((n - 1) / T_) / B_);
}

}  // namespace spillway
