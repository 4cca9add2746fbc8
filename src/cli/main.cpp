// The `spillway` command: train, sample, plan, bench, info. Sub-commands live in
// their own files and register themselves (command.h).
#include <algorithm>
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
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
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
