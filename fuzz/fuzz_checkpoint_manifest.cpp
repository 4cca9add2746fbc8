// libFuzzer target: the checkpoint manifest parser (parse_checkpoint_manifest, what
// --resume and `spillway checkpoint info` read first). Properties: it never crashes
// or throws; an accepted manifest has the format name and version this build reads,
// a step and data position that are not negative, plain file names and 16-hex-digit
// checksums.
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_support.h"
#include "train/checkpoint.h"

using namespace spillway;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto c = parse_checkpoint_manifest(text, "manifest.json");
  if (!c.ok()) return 0;
  fuzz::require(c->manifest.value("format", "") == "spillway-checkpoint", "accepted another format");
  fuzz::require(c->manifest["version"] == kCheckpointVersion, "accepted another version");
  fuzz::require(c->meta.step >= 0 && c->meta.data_batch >= 0, "accepted a negative step or data position");
  for (const auto& f : c->manifest["files"]) {
    const std::string name = f["name"].get<std::string>();
    fuzz::require(!name.empty() && name[0] != '.' && name.find('/') == std::string::npos, "accepted a file name that is not plain");
    fuzz::require(f["xxh3"].get<std::string>().size() == 16, "accepted a checksum that is not 16 digits");
  }
  return 0;
}
