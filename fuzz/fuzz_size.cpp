// libFuzzer target: the size parser (parse_size, parse_budget; --device-budget and
// the other size flags). Properties: an accepted size is at most kMaxSize; a budget
// is not 0 and equals the size; format_size never fails on it; a plain decimal
// byte count parses to its own value.
#include <cstdint>
#include <string_view>

#include "core/size.h"
#include "fuzz_support.h"

using namespace spillway;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto bytes = parse_size(text, "--fuzz");
  auto budget = parse_budget(text, "--fuzz");
  if (bytes.ok()) {
    fuzz::require(*bytes <= kMaxSize, "parse_size accepted a size above kMaxSize");
    fuzz::require(!format_size(*bytes).empty(), "format_size returned nothing");
    fuzz::require(budget.ok() == (*bytes != 0), "parse_budget disagrees with parse_size about 0");
    if (budget.ok()) fuzz::require(*budget == *bytes, "parse_budget and parse_size disagree");
  } else {
    fuzz::require(!budget.ok(), "parse_budget accepted what parse_size refused");
  }
  // Up to 18 decimal digits and nothing else: the value itself.
  bool digits = size > 0 && size <= 18;
  uint64_t value = 0;
  for (size_t i = 0; digits && i < size; ++i) {
    digits = data[i] >= '0' && data[i] <= '9';
    value = value * 10 + (data[i] - '0');
  }
  if (digits) fuzz::require(bytes.ok() && *bytes == value, "a plain byte count did not parse to its value");
  return 0;
}
