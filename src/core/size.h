// Byte sizes as people write them.
//
//   auto b = parse_size("24GiB");   // 25769803776
//   parse_size("1.5GB");            // 1500000000
//   parse_size("12 parsecs");       // error: names the text and the accepted forms
//   parse_size("10000000000GB");    // error: above kMaxSize (names the text and the limit)
//   format_size(1536);              // "1.50 KiB"
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"

namespace spillway {

// Accepts a plain byte count ("4096") or a number with a unit: B, KB, MB, GB, TB
// (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), case-insensitive, with
// optional space. `what` names the flag in the error ("--device-budget").
// Exact: fractions of up to 18 digits are computed in integers and rounded half up
// to a byte ("1.5GB" is 1500000000, "0.3MiB" 314573). Sizes above kMaxSize are an
// error that names the text and the limit.
inline constexpr uint64_t kMaxSize = uint64_t{INT64_MAX};  // 2^63 - 1 bytes: fits off_t; two sum within uint64_t
Result<uint64_t> parse_size(std::string_view text, std::string_view what = "size");

// Like parse_size, and also rejects 0.
Result<uint64_t> parse_budget(std::string_view text, std::string_view what);

std::string format_size(uint64_t bytes);

inline constexpr uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

}  // namespace spillway
