// Input files opened only when they are regular files, so that a named pipe, a device
// or a directory given where a file belongs is an error that names it instead of a
// read that waits for a writer forever or never ends.
//
//   SPILLWAY_ASSIGN_OR_RETURN(int fd, open_regular_file(path, "safetensors file"));
//   ... ::pread(fd, ...) ...; ::close(fd);
//   SPILLWAY_RETURN_IF_ERROR(check_regular_file(path, "machine file"));  // then std::ifstream
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <string>

#include "core/status.h"

namespace spillway {

// "a directory", "a named pipe (FIFO)", ... for a file that is not regular.
const char* file_kind(mode_t mode);

// Opens `path` read-only (close-on-exec) when it is a regular file. The open itself is
// non-blocking, so a FIFO cannot hold it up; the descriptor returned blocks as usual.
// Errors name `what` and the path: NotFound when it does not exist, InvalidArgument
// when it is a directory, device, pipe or socket, else the system's error. `st`, when
// given, receives the file's fstat (its size, so callers need not stat it again).
Result<int> open_regular_file(const std::string& path, const std::string& what, struct stat* st = nullptr);

// The same check for a reader that opens the file itself (std::ifstream): stat, no
// open.
Status check_regular_file(const std::string& path, const std::string& what);

}  // namespace spillway
