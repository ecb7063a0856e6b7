#!/bin/sh
# usage: ./build.sh file.cpp  -> ./file   (serialised on the shared CPU lock)
set -e
src="$1"; out="${src%.cpp}"
exec flock /tmp/meshtrain-cpu.lock g++ -std=c++17 -O2 -g0 -Wall -Wno-unused-variable "$src" -o "$out" \
  -I/usr/include/torch/csrc/api/include -ltorch -ltorch_cpu -lc10 -lpthread
