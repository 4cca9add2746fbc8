#include "core/size.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <string>

namespace spillway {

Result<uint64_t> parse_size(std::string_view text, std::string_view what) {
  auto fail = [&]() -> Result<uint64_t> {
    return Status::invalid_argument(std::string(what) + ": cannot parse '" + std::string(text) +
                                    "' as a size; expected a byte count or a number with a unit, "
                                    "e.g. 4096, 512MiB, 24GiB, 1.5GB");
  };
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  size_t start = i;
  bool dot = false;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || (text[i] == '.' && !dot))) {
    if (text[i] == '.') dot = true;
    ++i;
  }
  if (i == start) return fail();
  std::string number(text.substr(start, i - start));
  if (number == ".") return fail();
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  std::string unit;
  for (; i < text.size(); ++i) {
    if (std::isspace(static_cast<unsigned char>(text[i]))) break;
    unit += static_cast<char>(std::tolower(static_cast<unsigned char>(text[i])));
  }
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  if (i != text.size()) return fail();
  double mult = 0;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kb") mult = 1e3;
  else if (unit == "m" || unit == "mb") mult = 1e6;
  else if (unit == "g" || unit == "gb") mult = 1e9;
  else if (unit == "t" || unit == "tb") mult = 1e12;
  else if (unit == "kib") mult = 1024.0;
  else if (unit == "mib") mult = 1024.0 * 1024;
  else if (unit == "gib") mult = 1024.0 * 1024 * 1024;
  else if (unit == "tib") mult = 1024.0 * 1024 * 1024 * 1024;
  else return fail();
  if (!dot && mult == 1) {
    if (number.size() > 19) return fail();
    return static_cast<uint64_t>(std::stoull(number));
  }
  double v = std::stod(number) * mult;
  if (!std::isfinite(v) || v >= 1.8e19) return fail();
  return static_cast<uint64_t>(std::llround(v));
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
