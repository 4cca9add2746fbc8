// Status and Result: errors are values that carry their cause.
//
//   Result<int> parse(std::string_view s);
//   auto r = parse("12");
//   if (!r) { std::cerr << r.status().message(); return r.status(); }
//   int v = *r;
//
//   Status write_all(...) {
//     if (n < 0) return Status::io_error(errno_text("write", path, offset, errno));
//     SPILLWAY_RETURN_IF_ERROR(other_call());
//     return Status::ok();
//   }
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace spillway {

enum class StatusCode {
  Ok = 0,
  InvalidArgument,  // bad flag, bad size, bad shape
  NotFound,         // missing file or tensor
  OutOfMemory,      // a budget or an allocation cannot hold what was asked
  IoError,          // a system call on a file failed (EIO, short write, ...)
  NoSpace,          // ENOSPC
  Corrupt,          // checksum mismatch, bad magic, truncated file
  Unsupported,      // no CUDA in this build, O_DIRECT refused, ...
  Internal,         // a broken invariant of Spillway itself
  Interrupted,      // SIGINT or SIGTERM stopped the work (core/interrupt.h)
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return Status(); }
  static Status invalid_argument(std::string m) { return {StatusCode::InvalidArgument, std::move(m)}; }
  static Status not_found(std::string m) { return {StatusCode::NotFound, std::move(m)}; }
  static Status out_of_memory(std::string m) { return {StatusCode::OutOfMemory, std::move(m)}; }
  static Status io_error(std::string m) { return {StatusCode::IoError, std::move(m)}; }
  static Status no_space(std::string m) { return {StatusCode::NoSpace, std::move(m)}; }
  static Status corrupt(std::string m) { return {StatusCode::Corrupt, std::move(m)}; }
  static Status unsupported(std::string m) { return {StatusCode::Unsupported, std::move(m)}; }
  static Status internal(std::string m) { return {StatusCode::Internal, std::move(m)}; }
  static Status interrupted(std::string m) { return {StatusCode::Interrupted, std::move(m)}; }

  bool is_ok() const { return code_ == StatusCode::Ok; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "IoError: spill file /x: pwrite at offset 4096: No space left on device"
  std::string to_string() const;
  // The same status with "context: " put in front of the message.
  Status with_context(std::string_view context) const;

 private:
  StatusCode code_ = StatusCode::Ok;
  std::string message_;
};

// "pwrite /dir/f at offset 4096 (65536 bytes): No space left on device"; the status
// code follows errno (ENOSPC → NoSpace, else IoError).
Status errno_status(std::string_view what, int err);

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}
  Result(Status status) : status_(std::move(status)) {}
  bool ok() const { return value_.has_value(); }
  explicit operator bool() const { return ok(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace spillway

#define SPILLWAY_CONCAT_INNER(a, b) a##b
#define SPILLWAY_CONCAT(a, b) SPILLWAY_CONCAT_INNER(a, b)

#define SPILLWAY_RETURN_IF_ERROR(expr)                 \
  do {                                                 \
    ::spillway::Status spillway_status__ = (expr);     \
    if (!spillway_status__.is_ok()) return spillway_status__; \
  } while (0)

// SPILLWAY_ASSIGN_OR_RETURN(auto x, make_x());
#define SPILLWAY_ASSIGN_OR_RETURN(lhs, expr)                                 \
  auto SPILLWAY_CONCAT(spillway_result__, __LINE__) = (expr);                \
  if (!SPILLWAY_CONCAT(spillway_result__, __LINE__).ok())                    \
    return SPILLWAY_CONCAT(spillway_result__, __LINE__).status();            \
  lhs = std::move(SPILLWAY_CONCAT(spillway_result__, __LINE__)).value()
