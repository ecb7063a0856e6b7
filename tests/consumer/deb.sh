#!/usr/bin/env bash
# The Debian package: cpack -G DEB builds it; its Depends name libtorch and
# OpenBLAS; unpacked into an empty directory tree, the installed meshrun and
# meshtrain run (they find libmeshtrain through their RUNPATH).
#   tests/consumer/deb.sh BUILD_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
work=$build/deb-test
rm -rf "$work"
mkdir -p "$work/root"
(cd "$build" && cpack -G DEB -B "$work" > "$work/cpack.log") || { cat "$work/cpack.log"; exit 1; }
deb=$(ls "$work"/meshtrain_*.deb)
echo "package: $(basename "$deb")"
depends=$(dpkg-deb -f "$deb" Depends)
echo "Depends: $depends"
for needed in libtorch libopenblas0-pthread libsentencepiece0 libpcre2-8-0 libxxhash0; do
  [[ "$depends" == *"$needed"* ]] || { echo "Depends lacks $needed"; exit 1; }
done
dpkg-deb -x "$deb" "$work/root"
"$work/root/usr/bin/meshrun" --version
"$work/root/usr/bin/meshtrain" --version
test -f "$work/root/usr/lib/cmake/meshtrain/meshtrainConfig.cmake"
test -f "$work/root/usr/include/meshtrain/dp.h"
# The SentencePiece plugin ships beside the library and loads from there.
"$work/root/usr/bin/meshtrain" data --train-tokenizer 400 --out "$work/tok/lic" /usr/share/common-licenses/GPL-3 \
  | grep -q "vocabulary 400"
