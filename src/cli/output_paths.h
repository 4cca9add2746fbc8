// Output files of a command, checked before its work starts: none is one of its input
// files or another of its outputs (the output would overwrite it), and each one's folder
// exists and takes new files (a run must not fail at its end for want of a folder).
//
//   SPILLWAY_RETURN_IF_ERROR(check_output_paths({{"--data", f.data}},
//                                               {{"--metrics", f.metrics}, {"--trace", f.trace}}));
#pragma once

#include <string>
#include <vector>

#include "core/status.h"

namespace spillway::cli {

struct NamedPath {
  std::string flag;  // "--metrics"
  std::string path;  // empty: not given, skipped
  // Outputs: whether the path may be a directory (--save's model directories); its
  // folder must exist and be writable either way.
  bool may_be_directory = false;
  // Outputs: the input flag this one may overwrite ("--load" for --save: the model it
  // read, read whole at the start, replaced by the trained one at the end).
  std::string may_replace = {};
};

// Whether two paths name the same file: the same inode where both exist, else the same
// absolute path once normalized (symbolic links of existing parents resolved).
bool same_file(const std::string& a, const std::string& b);

Status check_output_paths(const std::vector<NamedPath>& inputs, const std::vector<NamedPath>& outputs);

}  // namespace spillway::cli
