#!/usr/bin/env bash
# GPU checks of issues #5, #17 and #20 on one GPU machine (sized for one H200, 16 cores; each step has a
# time limit, and together they may take longer than the 340 s budget, which gates only nocuda):
#
#     bash tests/gpu/run_checks.sh          # results under $XIRANG_GPU_OUT (default ./gpu-results)
#
# Uses the python with torch there ($PY, default python3; a CUDA torch expected; installs
# torch==$XIRANG_CUDA_TORCH, default 2.14.1, if it has none). Steps, each with a time limit, each
# writing its log and a PASS/FAIL/SKIP line to $OUT/summary.txt as it goes (partial results
# survive a kill):
#   build        pip install --no-build-isolation --no-deps . (XIRANG_BUILD_CUDA=1, MAX_JOBS=16),
#                and alongside it (native) tests/gpu/device_checks.cc with nvcc -arch=native over
#                the core library (cmake target xirang_core) and cuda/{kernels.cu,cuda_api,nccl_api}
#   device_kernels  every kernel of core/device/kernels.h on the GPU == the host grid emulator
#                (device_checks kernels: every dtype x op, sizes 0 .. 2^20 + 3, edge values)
#   device_nccl  a one-rank communicator of the real libnccl.so.2 (torch's wheel): send/recv to
#                itself, every core collective over NcclLink + DeviceReducer == the host engine,
#                abort (device_checks nccl)
#   kernel_bits  CUDA kernels == CPU codec bits (tests/gpu/check_kernels.py bits)
#   kernel_speed kernels vs device-to-device copy at 256 MiB, target >= 0.8 (check_kernels.py speed)
#   collectives  4 ranks on GPU 0, the mirror engine (the ranks share host memory; auto must not
#                choose NCCL for ranks sharing a GPU): == CPU path bitwise; allreduce and coalesced
#                batches behind a long kernel (check_collectives.py; its --cpu flag dry-runs the
#                script here, as check_ddp.py's does)
#   collectives_nccl  the same checks through the backend's NCCL engine, which auto must choose for
#                one rank (NCCL refuses two ranks on one GPU): the device Comm, kernels on the side
#                stream, the stream discipline and the communicator's creation through the store
#   nccl_fallback  one rank under auto with NCCL_SOCKET_IFNAME naming no interface: NCCL cannot make
#                the communicator that auto chose, so the rank falls back to the staged engine (WARNING),
#                same checks
#   collectives_staged  the same 4 ranks with XIRANG_TRANSPORT_LOCAL=tcp (no shared-memory domain):
#                the staged engine (device reducer kernels over a StagedLink on TCP) == CPU bitwise
#   ddp          DDP + xirang hook, 50 steps: loss within 2% of gloo fp32, replicas bitwise equal;
#                AMP (fp16 autocast, GradScaler, an inf step) within 2% of gloo under the same AMP
#                (one host: the hook's exact fp32 local average)
#   ddp_staged   the same with XIRANG_TRANSPORT_LOCAL=tcp: the hook's bf16 error-feedback groups
#                through the staged engine
#   ddp_nccl     the same on one rank through the NCCL engine, 50 steps (the hook's device buffers),
#                and its step time beside torch's bf16_compress_hook on NCCL (printed, not judged)
#   fsdp         xirang.fsdp on CUDA, 2 ranks on GPU 0 (mirror engine): the compressed reduce-scatter
#                (fp32/bf16/int8 + error feedback) on a side stream behind a running producer kernel
#                == the CPU call bitwise; FSDP2 gradients within each wire's bound of an fp64
#                reference (tests/gpu/check_fsdp.py; its --cpu flag dry-runs the script here)
#   nocuda       XIRANG_BUILD_CUDA=0 build (another dir): CUDA tensor -> "CUDA path is not built";
#                skipped when under 100 s of the budget are left
# Exit status: number of failed steps (0 = all passed or skipped).
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
OUT="${XIRANG_GPU_OUT:-./gpu-results}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PY:-python3}"
export MAX_JOBS="${MAX_JOBS:-16}"
budget="${XIRANG_GPU_BUDGET_S:-340}"
start=$(date +%s)
failed=0
summary="$OUT/summary.txt"
: > "$summary"

left() { echo $(( budget - ($(date +%s) - start) )); }
note() { echo "$*" | tee -a "$summary"; }
# step NAME LIMIT_S CMD...: runs CMD in /tmp (so the installed xirang is imported, not python/ of
# this tree) with a time limit, output to $OUT/NAME.log; counts a failure.
step() {
    local name="$1" limit="$2"
    shift 2
    local t0 rc
    t0=$(date +%s)
    (cd /tmp && timeout "$limit" "$@") > "$OUT/$name.log" 2>&1
    rc=$?
    if [ $rc = 0 ]; then
        note "PASS $name ($(( $(date +%s) - t0 )) s)"
    else
        failed=$((failed + 1))
        note "FAIL $name (rc $rc$([ $rc = 124 ] && echo ', timed out'), $(( $(date +%s) - t0 )) s; log $name.log)"
        tail -n 15 "$OUT/$name.log" | sed 's/^/    /'
    fi
    return $rc
}

# --- torch ------------------------------------------------------------------------------------
torch_version="${XIRANG_CUDA_TORCH:-2.14.1}"
if ! "$PY" -c "import torch; assert torch.version.cuda and torch.cuda.is_available()" 2>/dev/null; then
    note "installing torch==$torch_version (no CUDA torch / no GPU seen by $PY)"
    "$PY" -m pip install -q "torch==$torch_version" > "$OUT/torch-install.log" 2>&1 || note "FAIL torch install"
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.get_device_name(0))" \
    2>&1 | tee -a "$summary"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$summary" 2>&1 || true

# --- build ------------------------------------------------------------------------------------
# pyproject.toml's SPDX license string needs setuptools >= 77 (no build isolation here). A machine
# that reaches no index takes a wheel from ./.whl when one was carried there.
if ! "$PY" -c "import setuptools, sys; sys.exit(tuple(map(int, setuptools.__version__.split('.')[:2])) < (77, 0))" 2>/dev/null; then
    "$PY" -m pip install -q ${root:+$([ -d "$root/.whl" ] && echo "--find-links $root/.whl")} "setuptools>=77" \
        > "$OUT/setuptools-install.log" 2>&1 || note "FAIL setuptools>=77 install (no index? carry a wheel in .whl/)"
fi
# The native checks' build runs alongside the extension's (half the cores each).
site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null)"
nccl_dir="$site/nvidia/nccl"
native="$root/build/gpu-native"
# The core library alone: no Catch2 there, and that machine's compilers may warn where ours do not.
(step native 200 bash -c "mkdir -p '$native' && cmake -S '$root' -B '$native' -DCMAKE_BUILD_TYPE=Release \
    -DXIRANG_CORE_TESTS=OFF -DXIRANG_WERROR=OFF \
    && cmake --build '$native' --target xirang_core -j$(( MAX_JOBS / 2 )) \
    && cd '$root' && '${CUDA_HOME:+$CUDA_HOME/bin/}nvcc' -std=c++20 -O2 --fmad=false -arch=native -Icsrc -Itests/cpp -isystem '$nccl_dir/include' \
       -DXIRANG_HAVE_NCCL_H tests/gpu/device_checks.cc csrc/cuda/cuda_api.cc csrc/cuda/nccl_api.cc \
       csrc/cuda/kernels.cu '$native/libxirang_core.a' -ldl -o '$native/device_checks'") &
native_pid=$!
if ! step build 170 env XIRANG_BUILD_CUDA=1 MAX_JOBS=$(( MAX_JOBS / 2 )) "$PY" -m pip install --no-build-isolation \
        --no-deps -v "$root"; then
    note "build failed: nothing else can run"
    wait "$native_pid"
    exit 1
fi
wait "$native_pid" || failed=$((failed + 1))
(cd /tmp && "$PY" -c "import xirang; print(xirang.build_info())") 2>&1 | tee -a "$summary"

# --- checks -----------------------------------------------------------------------------------
# The native checks (no torch): the kernels against the grid emulator; real NCCL, one rank.
if [ -x "$native/device_checks" ]; then
    step device_kernels 60 "$native/device_checks" kernels
    grep -h "FAIL" "$OUT/device_kernels.log" >> "$summary" 2>/dev/null
    step device_nccl 60 env XIRANG_NCCL_LIBRARY="$nccl_dir/lib/libnccl.so.2" "$native/device_checks" nccl
    grep -h "device_checks:" "$OUT/device_nccl.log" >> "$summary" 2>/dev/null
else
    note "SKIP device_kernels, device_nccl (the native build failed: native.log)"
fi
# The CPU reference of the bit check is the scalar codec (the AVX paths give the same bits).
step kernel_bits 60 env XIRANG_CODEC=scalar "$PY" "$root/tests/gpu/check_kernels.py" "$OUT" bits
step kernel_speed 40 "$PY" "$root/tests/gpu/check_kernels.py" "$OUT" speed
grep -h "speed" "$OUT/kernel_speed.log" >> "$summary" 2>/dev/null
step collectives 90 env XIRANG_DEBUG=INFO "$PY" "$root/tests/gpu/check_collectives.py" "$OUT" 4
grep -h "FAIL\|CUDA tensors run" "$OUT/collectives.log" >> "$summary" 2>/dev/null
step collectives_staged 60 env XIRANG_TRANSPORT_LOCAL=tcp XIRANG_DEBUG=INFO "$PY" "$root/tests/gpu/check_collectives.py" "$OUT" 4
grep -h "FAIL\|CUDA tensors run" "$OUT/collectives_staged.log" >> "$summary" 2>/dev/null
step collectives_nccl 60 env XIRANG_CUDA_TRANSPORT=auto XIRANG_DEBUG=INFO "$PY" "$root/tests/gpu/check_collectives.py" "$OUT" 1
grep -h "FAIL\|NCCL communicator\|CUDA tensors run" "$OUT/collectives_nccl.log" >> "$summary" 2>/dev/null
# auto chose NCCL for one rank, but NCCL cannot make the communicator (no such socket interface for its
# bootstrap): the rank must fall back to the staged engine with a WARNING and give the same results
step nccl_fallback 60 env XIRANG_CUDA_TRANSPORT=auto NCCL_SOCKET_IFNAME=xirang_no_such_if XIRANG_CHECK_EXPECT_ENGINE=staged \
    XIRANG_DEBUG=INFO "$PY" "$root/tests/gpu/check_collectives.py" "$OUT" 1
grep -h "FAIL\|falls back\|CUDA tensors run" "$OUT/nccl_fallback.log" >> "$summary" 2>/dev/null
step ddp 120 "$PY" "$root/tests/gpu/check_ddp.py" "$OUT" 2 50
grep -h "ddp" "$OUT/ddp.log" >> "$summary" 2>/dev/null
step ddp_staged 90 env XIRANG_TRANSPORT_LOCAL=tcp "$PY" "$root/tests/gpu/check_ddp.py" "$OUT" 2 50
grep -h "ddp" "$OUT/ddp_staged.log" >> "$summary" 2>/dev/null
step ddp_nccl 90 env XIRANG_CUDA_TRANSPORT=nccl "$PY" "$root/tests/gpu/check_ddp.py" "$OUT" 1 50
grep -h "ddp" "$OUT/ddp_nccl.log" >> "$summary" 2>/dev/null
step fsdp 150 "$PY" "$root/tests/gpu/check_fsdp.py" "$OUT" 2
grep -h "fsdp" "$OUT/fsdp.log" >> "$summary" 2>/dev/null

# --- the CPU-only build's error on a CUDA tensor ---------------------------------------------
if [ "$(left)" -ge 100 ]; then
    nocuda="$(mktemp -d)"
    tar -C "$root" --exclude=./build --exclude=./.git --exclude='*.so' --exclude="./$(basename "$OUT")" -cf - . \
        | tar -C "$nocuda" -xf -
    step nocuda "$(( $(left) - 5 ))" bash -c "cd '$nocuda' && XIRANG_BUILD_CUDA=0 '$PY' setup.py build_ext --inplace \
        && cd /tmp && PYTHONPATH='$nocuda/python' '$PY' '$root/tests/gpu/check_nocuda.py'"
else
    note "SKIP nocuda (only $(left) s of the ${budget} s budget left)"
fi

note "done in $(( $(date +%s) - start )) s, $failed failed step(s); results in $OUT"
exit "$failed"
