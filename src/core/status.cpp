#include "core/status.h"

#include <cerrno>
#include <cstring>

namespace spillway {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::Ok: return "Ok";
    case StatusCode::InvalidArgument: return "InvalidArgument";
    case StatusCode::NotFound: return "NotFound";
    case StatusCode::OutOfMemory: return "OutOfMemory";
    case StatusCode::IoError: return "IoError";
    case StatusCode::NoSpace: return "NoSpace";
    case StatusCode::Corrupt: return "Corrupt";
    case StatusCode::Unsupported: return "Unsupported";
    case StatusCode::Internal: return "Internal";
    case StatusCode::Interrupted: return "Interrupted";
  }
  return "Unknown";
}

std::string Status::to_string() const {
  if (is_ok()) return "Ok";
  return std::string(status_code_name(code_)) + ": " + message_;
}

Status Status::with_context(std::string_view context) const {
  if (is_ok()) return *this;
  return Status(code_, std::string(context) + ": " + message_);
}

Status errno_status(std::string_view what, int err) {
  std::string m = std::string(what) + ": " + std::strerror(err);
  if (err == ENOSPC || err == EDQUOT) return Status::no_space(std::move(m));
  return Status::io_error(std::move(m));
}

}  // namespace spillway
