#!/usr/bin/env bash
# Fuzzes xirang's wire parsers with libFuzzer for a bounded time (not part of every CI run):
#
#     bash tests/fuzz/run.sh              # 120 s
#     FUZZ_SECONDS=600 bash tests/fuzz/run.sh
#
# Targets (tests/fuzz/fuzz_wire.cc): frame header decode/compare, hello parse, the listener's
# handshake fed a stranger's bytes, the point-to-point engine fed an authenticated peer's bytes.
# Needs clang with libFuzzer (Debian: clang libclang-rt-14-dev; installed when run as root).
# Built with ASan + UBSan; a crash leaves crash-* in build/fuzz/ and exits non-zero.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
secs="${FUZZ_SECONDS:-120}"
cxx="${CXX_FUZZ:-clang++}"
if ! command -v "$cxx" >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang libclang-rt-14-dev) >&2
    else
        echo "fuzz: $cxx not found (apt-get install clang libclang-rt-14-dev)" >&2
        exit 1
    fi
fi
out=build/fuzz
mkdir -p "$out/corpus"
cp -n tests/fuzz/corpus/* "$out/corpus/" 2>/dev/null || true
srcs=(csrc/core/env.cc csrc/core/reduce.cc csrc/core/codec.cc csrc/core/transport/frame.cc csrc/core/transport/auth.cc csrc/core/transport/socket.cc
      csrc/core/transport/acceptor.cc csrc/core/transport/p2p.cc csrc/core/transport/tcp.cc csrc/core/transport/tcp_exchange.cc)
"$cxx" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I csrc -I tests/cpp tests/fuzz/fuzz_wire.cc "${srcs[@]}" -lpthread -o "$out/fuzz_wire"
echo "fuzz: running $out/fuzz_wire for $secs s" >&2
cd "$out"
XIRANG_DEBUG=WARN ./fuzz_wire -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 corpus 2> fuzz.log \
    || { tail -60 fuzz.log; echo "fuzz: FAILED (see $out/fuzz.log, crash-* files)" >&2; exit 1; }
grep -E "stat::number_of_executed_units|stat::peak_rss_mb" fuzz.log >&2 || true
echo "fuzz: no crash, hang or leak in $secs s" >&2
