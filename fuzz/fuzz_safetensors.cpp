// libFuzzer target: the safetensors header parser (SafetensorsReader::open) and
// the reading of the tensors it accepts (read_f32), on a file holding the input.
// Properties: every accepted entry's bytes are inside the file, of the size its
// dtype and shape imply, and no two entries share bytes; read_f32 returns numel values.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "fuzz_support.h"
#include "model/safetensors.h"

using namespace spillway;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = fuzz::input_file(data, size, ".safetensors");
  auto reader = SafetensorsReader::open(path);
  if (!reader.ok()) return 0;
  std::vector<const SafetensorsEntry*> by_offset;
  for (const SafetensorsEntry& e : reader->entries()) {
    fuzz::require(e.begin <= e.end, "an entry ends before it begins");
    fuzz::require(e.end <= size, "an entry's data runs past the end of the file");
    fuzz::require(reader->find(e.name) == &e, "find() does not return the entry by its name");
    by_offset.push_back(&e);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const SafetensorsEntry* a, const SafetensorsEntry* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    fuzz::require(by_offset[i]->begin >= by_offset[i - 1]->end, "two entries share bytes");
  for (const SafetensorsEntry& e : reader->entries()) {
    const int elem = e.dtype == "F32" ? 4 : (e.dtype == "F16" || e.dtype == "BF16") ? 2 : 0;
    if (elem == 0) continue;
    fuzz::require(e.end - e.begin == static_cast<uint64_t>(e.numel()) * elem, "an entry's size disagrees with its shape");
    auto values = reader->read_f32(e);
    if (values.ok()) fuzz::require(values->size() == static_cast<size_t>(e.numel()), "read_f32 returned the wrong count");
  }
  return 0;
}
