#include "core/size.h"

#include <cctype>
#include <algorithm>
#include <cstdio>
#include <string>

namespace spillway {

Result<uint64_t> parse_size(std::string_view text, std::string_view what) {
  auto fail = [&]() -> Result<uint64_t> {
    return Status::invalid_argument(std::string(what) + ": cannot parse '" + std::string(text) +
                                    "' as a size; expected a byte count or a number with a unit, "
                                    "e.g. 4096, 512MiB, 24GiB, 1.5GB");
  };
  auto too_large = [&]() -> Result<uint64_t> {
    return Status::invalid_argument(std::string(what) + ": '" + std::string(text) +
                                    "' is larger than the largest size accepted, " + std::to_string(kMaxSize) +
                                    " bytes (8 EiB - 1)");
  };
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  // The integer digits, then the fraction digits after an optional point.
  std::string whole, fraction;
  bool dot = false;
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (std::isdigit(static_cast<unsigned char>(c))) (dot ? fraction : whole) += c;
    else if (c == '.' && !dot) dot = true;
    else break;
  }
  if (whole.empty() && fraction.empty()) return fail();
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  std::string unit;
  for (; i < text.size(); ++i) {
    if (std::isspace(static_cast<unsigned char>(text[i]))) break;
    unit += static_cast<char>(std::tolower(static_cast<unsigned char>(text[i])));
  }
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  if (i != text.size()) return fail();
  uint64_t mult = 0;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kb") mult = 1000;
  else if (unit == "m" || unit == "mb") mult = 1000'000;
  else if (unit == "g" || unit == "gb") mult = 1000'000'000;
  else if (unit == "t" || unit == "tb") mult = 1000'000'000'000;
  else if (unit == "kib") mult = uint64_t{1} << 10;
  else if (unit == "mib") mult = uint64_t{1} << 20;
  else if (unit == "gib") mult = uint64_t{1} << 30;
  else if (unit == "tib") mult = uint64_t{1} << 40;
  else return fail();

  // Exact: bytes = (whole + fraction / 10^k) · mult, rounded half up to a byte.
  whole.erase(0, std::min(whole.find_first_not_of('0'), whole.size()));
  while (!fraction.empty() && fraction.back() == '0') fraction.pop_back();
  if (whole.size() > 19) return too_large();
  if (fraction.size() > 18)
    return Status::invalid_argument(std::string(what) + ": '" + std::string(text) +
                                    "' has more than 18 digits after the point; a size is counted in whole bytes");
  unsigned __int128 bytes = 0;
  for (char c : whole) bytes = bytes * 10 + static_cast<unsigned>(c - '0');
  bytes *= mult;  // < 10^19 · 2^40 < 2^128
  if (!fraction.empty()) {
    unsigned __int128 digits = 0, scale = 1;
    for (char c : fraction) {
      digits = digits * 10 + static_cast<unsigned>(c - '0');
      scale *= 10;
    }
    // digits · mult < 10^18 · 2^40 < 2^128
    bytes += (digits * mult + scale / 2) / scale;
  }
  if (bytes > kMaxSize) return too_large();
  return static_cast<uint64_t>(bytes);
}

Result<uint64_t> parse_budget(std::string_view text, std::string_view what) {
  auto r = parse_size(text, what);
  if (!r) return r;
  if (*r == 0) {
    return Status::invalid_argument(std::string(what) + ": a budget of 0 bytes cannot hold anything; give a positive size such as 512MiB");
  }
  return r;
}

std::string format_size(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) { v /= 1024.0; ++u; }
  char buf[64];
  if (u == 0) std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  else std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace spillway
