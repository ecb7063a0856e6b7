// meshrun: the launcher. Logic lives in app/launch (meshtrain::launch).
#include <algorithm>
#include <iostream>

#include "app/launch/launcher.h"
#include "meshtrain/util.h"
#include "meshtrain/version.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  // meshrun's own flags end at "--" or the program; the program's --help is its own.
  if (meshtrain::launch::launch_asks_for_help(args)) {
    std::cout << meshtrain::launch::launch_usage();
    return 0;
  }
  if (args.size() == 1 && args[0] == "--version") {
    std::cout << "meshrun " << meshtrain::version() << std::endl;
    return 0;
  }
  try {
    return meshtrain::launch::run_launcher(meshtrain::launch::parse_launch_args(args));
  } catch (const meshtrain::ConfigError& e) {
    std::cerr << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "meshrun: " << e.what() << std::endl;
    return 1;
  }
}
