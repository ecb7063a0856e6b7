// Built with nothing but `pkg-config --cflags --libs meshtrain`: the headers'
// version must be the library's.
#include <meshtrain/version.h>

#include <cstring>
#include <iostream>

int main() {
  std::cout << "pkg-config build: headers " << MESHTRAIN_VERSION << ", library " << meshtrain::version() << std::endl;
  return std::strcmp(MESHTRAIN_VERSION, meshtrain::version()) == 0 ? 0 : 1;
}
