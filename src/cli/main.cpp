// The `spillway` command: train, sample, plan, bench, info. Sub-commands live in
// their own files and register themselves (command.h).
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <map>

#include "cli/command.h"
#include "core/interrupt.h"

namespace spillway::cli {

std::vector<RegisteredCommand>& registered_commands() {
  static std::vector<RegisteredCommand> commands;
  return commands;
}

CommandRegistration::CommandRegistration(std::string path, std::string help, CommandSetup setup) {
  registered_commands().push_back({std::move(path), std::move(help), std::move(setup)});
}

int fail(const Status& s) {
  if (s.code() == StatusCode::Interrupted) {
    std::cerr << "spillway: " << s.message() << "\n";
    return interrupt_exit_code();
  }
  std::cerr << "spillway: error: " << s.to_string() << "\n";
  return 1;
}

namespace {

// "-12" (with an optional sign and leading zeros, which are dropped so that CLI11
// does not read "010" as octal) as a whole number in [lo, hi]; "" on success.
std::string check_whole_number(std::string& text, long double lo, long double hi, const char* range) {
  std::string digits = text;
  std::string sign;
  if (!digits.empty() && (digits[0] == '-' || digits[0] == '+')) {
    if (digits[0] == '-') sign = "-";
    digits.erase(0, 1);
  }
  const bool all_digits = !digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos;
  if (all_digits) {
    digits.erase(0, std::min(digits.find_first_not_of('0'), digits.size() - 1));
    const long double v = std::strtold((sign + digits).c_str(), nullptr);
    if (digits.size() <= 20 && v >= lo && v <= hi) {
      text = sign + digits;
      return "";
    }
  }
  return std::string("expected a whole number from ") + range + ", got '" + text + "'";
}

// Every numeric flag gets its expected form checked before CLI11 converts it, so that
// a bad number is an error naming the flag and the form. Integer flags are `int`
// (CLI11's "INT"), seeds `uint64_t` ("UINT"), the rest floating point ("FLOAT").
void check_numeric_flags(CLI::App* app) {
  for (CLI::Option* opt : app->get_options()) {
    const std::string type = opt->get_type_name();
    // transform, not check: the whole-number check rewrites "010" as "10".
    if (type == "INT") {
      opt->transform(CLI::Validator(
          [](std::string& t) { return check_whole_number(t, INT32_MIN, INT32_MAX, "-2147483648 to 2147483647"); }, ""));
    } else if (type == "UINT") {
      opt->transform(CLI::Validator(
          [](std::string& t) { return check_whole_number(t, 0, 18446744073709551615.0L, "0 to 18446744073709551615"); },
          ""));
    } else if (type == "FLOAT") {
      opt->check(CLI::Validator(
          [](std::string& t) -> std::string {
            char* end = nullptr;
            errno = 0;
            const double v = std::strtod(t.c_str(), &end);
            if (t.empty() || end != t.c_str() + t.size() || errno == ERANGE || !std::isfinite(v))
              return "expected a finite number such as 0.5, 3 or 6e-4, got '" + t + "'";
            return "";
          },
          ""));
    }
  }
  for (CLI::App* sub : app->get_subcommands(std::function<bool(CLI::App*)>{})) check_numeric_flags(sub);
}

// "spillway bench train": the deepest sub-command that was parsed.
std::string parsed_command(CLI::App& app) {
  std::string path = "spillway";
  CLI::App* at = &app;
  for (;;) {
    auto subs = at->get_subcommands();
    if (subs.empty()) return path;
    at = subs.front();
    path += " " + at->get_name();
  }
}

}  // namespace
}  // namespace spillway::cli

int main(int argc, char** argv) {
  using namespace spillway::cli;
  CLI::App app{"Spillway: train models whose training state is larger than GPU memory"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "spillway 0.1");
  auto commands = registered_commands();
  std::sort(commands.begin(), commands.end(), [](auto& a, auto& b) { return a.path < b.path; });
  std::map<std::string, CLI::App*> groups;
  std::vector<std::pair<CLI::App*, CommandRun>> runs;
  for (auto& c : commands) {
    CLI::App* parent = &app;
    std::string name = c.path;
    auto space = c.path.find(' ');
    if (space != std::string::npos) {
      std::string group = c.path.substr(0, space);
      name = c.path.substr(space + 1);
      auto it = groups.find(group);
      if (it == groups.end()) {
        CLI::App* g = app.add_subcommand(group, group + " sub-commands");
        g->require_subcommand(1);
        it = groups.emplace(group, g).first;
      }
      parent = it->second;
    }
    CLI::App* sub = parent->add_subcommand(name, c.help);
    runs.emplace_back(sub, c.setup(*sub));
  }
  check_numeric_flags(&app);
  // A word where a command belongs that names none: said so, with the commands there
  // (CLI11 would say only that a subcommand is required).
  {
    CLI::App* at = &app;
    std::string path = "spillway";
    for (int i = 1; i < argc && argv[i][0] != '-'; ++i) {
      auto subs = at->get_subcommands(std::function<bool(CLI::App*)>{});
      if (subs.empty()) break;
      CLI::App* next = nullptr;
      std::string names;
      for (CLI::App* sub : subs) {
        if (sub->get_name() == argv[i]) next = sub;
        names += (names.empty() ? "" : ", ") + sub->get_name();
      }
      if (next == nullptr) {
        std::cerr << "spillway: error: " << path << ": unknown command '" << argv[i] << "'; expected one of: " << names
                  << " (see " << path << " --help)\n";
        return 1;
      }
      at = next;
      path += " " + at->get_name();
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version print and exit 0; every other parse error is exit code 1.
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    std::cerr << "spillway: error: " << e.what() << " (see " << parsed_command(app) << " --help)\n";
    return 1;
  }
  for (auto& [sub, run] : runs) {
    if (!sub->parsed()) continue;
    const int code = run();
    // A signal that came after the command's last check: its work is complete.
    if (code == 0 && spillway::interrupted()) {
      std::cerr << "spillway: " << spillway::signal_name(spillway::interrupt_signal())
                << " received as the command finished; its work is complete\n";
      return spillway::interrupt_exit_code();
    }
    return code;
  }
  std::cerr << app.help();
  return 2;
}
