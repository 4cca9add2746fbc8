// safetensors files: the reader (F32, F16 and BF16 as F32) and an atomic F32 writer.
// Models in them (Hugging Face names, config.json, shards): model/hf_model.h.
//
//   auto f = SafetensorsReader::open("any.safetensors");
//   if (!f) return f.status();
//   for (const SafetensorsEntry& e : f->entries()) { auto v = f->read_f32(e); ... }
//   SPILLWAY_RETURN_IF_ERROR(write_safetensors("out.safetensors", tensors, {{"format", "pt"}}));
//
// Format: 8-byte little-endian header length n; n bytes of JSON
//   {"__metadata__": {"k": "v", ...}, "name": {"dtype": "F32", "shape": [..],
//    "data_offsets": [begin, end]}, ...}
// then the data buffer; offsets are relative to the buffer's start, row-major,
// little-endian. The header is padded with spaces to a multiple of 8 bytes.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace spillway {

struct SafetensorsEntry {
  std::string name;
  std::string dtype;           // "F32", "F16", "BF16", "I64", ...
  std::vector<int64_t> shape;  // as stored
  uint64_t begin = 0;          // byte offsets into the data buffer, [begin, end)
  uint64_t end = 0;
  int64_t numel() const;
};

class SafetensorsReader {
 public:
  // Reads and checks the header: length within the file, valid JSON, every entry
  // with dtype, shape and data_offsets inside the data buffer and of the size its
  // dtype and shape imply.
  static Result<SafetensorsReader> open(const std::string& path);

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const SafetensorsEntry* find(std::string_view name) const;  // nullptr when absent
  // The entry's values as F32 (from F32, F16 or BF16), in stored order.
  Result<std::vector<float>> read_f32(const SafetensorsEntry& e) const;
  // Elements [first, first + count) of it (count clipped to the entry's end).
  Result<std::vector<float>> read_f32(const SafetensorsEntry& e, uint64_t first, uint64_t count) const;

 private:
  std::string path_;
  uint64_t data_start_ = 0;  // file offset of the data buffer
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// One tensor to write, F32.
struct SafetensorsTensor {
  std::string name;
  std::vector<int64_t> shape;
  // Produces the values (numel of shape) when the writer reaches this tensor, so
  // that a large model need not be in memory at once.
  std::function<Result<std::vector<float>>()> values;
};

// Writes an F32 safetensors file: to PATH.tmp-<pid>-<random> (core/atomic_file.h),
// fsynced, renamed over PATH, and PATH's folder fsynced. On an error, or a signal
// that ends the process, PATH is left as it was and the temporary file removed.
Status write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                         const std::map<std::string, std::string>& metadata = {});

}  // namespace spillway
