#include "cli/output_paths.h"

#include <unistd.h>

#include <cerrno>
#include <filesystem>

namespace spillway::cli {

namespace fs = std::filesystem;

bool same_file(const std::string& a, const std::string& b) {
  std::error_code ea, eb;
  if (fs::exists(a, ea) && fs::exists(b, eb)) {
    std::error_code ec;
    const bool eq = fs::equivalent(a, b, ec);
    return !ec && eq;
  }
  const fs::path ca = fs::weakly_canonical(a, ea), cb = fs::weakly_canonical(b, eb);
  return !ea && !eb && ca == cb;
}

Status check_output_paths(const std::vector<NamedPath>& inputs, const std::vector<NamedPath>& outputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    const NamedPath& o = outputs[i];
    if (o.path.empty()) continue;
    for (const NamedPath& in : inputs)
      if (!in.path.empty() && in.flag != o.may_replace && same_file(o.path, in.path))
        return Status::invalid_argument(o.flag + " " + o.path + " is the file that " + in.flag + " reads (" + in.path +
                                        "); writing it would destroy it: give another path");
    for (size_t j = i + 1; j < outputs.size(); ++j)
      if (!outputs[j].path.empty() && same_file(o.path, outputs[j].path))
        return Status::invalid_argument(o.flag + " " + o.path + " and " + outputs[j].flag + " " + outputs[j].path +
                                        " are the same file: give each its own");
    std::error_code ec;
    if (!o.may_be_directory && fs::is_directory(o.path, ec))
      return Status::invalid_argument(o.flag + " " + o.path + " is a directory; expected a file name");
    std::string trimmed = o.path;
    while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
    const fs::path parent = fs::path(trimmed).parent_path();
    const std::string folder = parent.empty() ? "." : parent.string();
    if (!fs::is_directory(folder, ec))
      return Status::invalid_argument(o.flag + " " + o.path + ": the folder " + folder +
                                      (fs::exists(folder, ec) ? " is not a directory" : " does not exist") +
                                      " (make it first: checked before any work)");
    if (::access(folder.c_str(), W_OK) != 0)
      return errno_status(o.flag + " " + o.path + ": cannot write into " + folder, errno);
  }
  return Status::ok();
}

}  // namespace spillway::cli
