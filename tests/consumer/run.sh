#!/usr/bin/env bash
# The install as a user meets it: `cmake --install` into a temporary prefix,
# then an out-of-tree project finds it with find_package (CMake) and with
# pkg-config, builds, and runs under the installed meshrun on 2 ranks.
#   tests/consumer/run.sh BUILD_DIR
set -euo pipefail
src=$(cd "$(dirname "$0")" && pwd)
build=$(cd "$1" && pwd)
work=$build/consumer-test
rm -rf "$work/prefix"
mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" > "$work/install.log"
launcher=()
command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$work/prefix" "${launcher[@]}" > "$work/configure.log"
cmake --build "$work/build" -j2 > "$work/build.log" || { cat "$work/build.log"; exit 1; }

pc=$(find "$work/prefix" -name meshtrain.pc)
export PKG_CONFIG_PATH=$(dirname "$pc")
libdir=$(pkg-config --variable=libdir meshtrain)
g++ "$src/version_check.cpp" $(pkg-config --cflags --libs meshtrain) -Wl,-rpath,"$libdir" -o "$work/version_check"
"$work/version_check"

"$work/prefix/bin/meshrun" --version
"$work/prefix/bin/meshtrain" --version
"$work/prefix/bin/meshrun" --nproc-per-node 2 -- "$work/build/consumer"
# The installed libmeshtrain finds its SentencePiece plugin beside itself (a
# model trained and used through it by the installed tool).
"$work/prefix/bin/meshtrain" data --train-tokenizer 400 --out "$work/tok/lic" /usr/share/common-licenses/GPL-3 \
  | grep -q "vocabulary 400"
