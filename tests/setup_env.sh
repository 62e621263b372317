# Shared set-up for examples/demo.sh and tests/run.sh. Source it (bash), don't run it:
#
#     source tests/setup_env.sh || exit 1
#
# Idempotent. It
#   1. picks the Python: `python3` if it can import torch (a training container's torch is used as
#      is), else .venv/ at the repository root, created on first use, with torch==$XIRANG_TORCH_VERSION;
#   2. installs the Python packages the demo and tests need when they are missing (numpy,
#      scikit-learn, tqdm, pytest), always under a constraint pinning the torch already present;
#   3. builds and installs xirang (`pip install --no-build-isolation --no-deps .`), skipped when a
#      hash of the sources matches the stamp build/.xirang-install-stamp and `import xirang` works.
#
# It sets and exports:
#   PY                  the python to use (absolute path)
#   XIRANG_ROOT         the repository root
#   XIRANG_CONSTRAINT   a pip constraint file pinning the present torch (use it with `pip -c`)
#   XIRANG_AVAILABLE    1 if `import xirang` works after the build, else 0
#   XIRANG_BUILD_ERROR  why it is 0 (empty when 1)
# Knobs: XIRANG_TORCH_VERSION (default 2.13.0), XIRANG_FORCE_REBUILD=1, XIRANG_SKIP_BUILD=1,
# XIRANG_WERROR=1 (build xirang._C with -Werror: a warning in xirang's own C++ fails the build).
# Returns non-zero only when no usable Python with torch can be had.

_xr_log() { printf '[setup_env] %s\n' "$*" >&2; }

_xr_setup() {
    XIRANG_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    export XIRANG_ROOT
    local torch_version="${XIRANG_TORCH_VERSION:-2.13.0}"

    # 1. The python (resolved to the interpreter itself, not a pyenv shim or a symlink).
    local probe='import sys, torch; print(sys.executable); print(torch.__version__)' out
    if [ -n "${PY:-}" ] && out="$("$PY" -c "$probe" 2>/dev/null)"; then
        :   # the caller's choice, kept
    elif command -v python3 >/dev/null 2>&1 && out="$(python3 -c "$probe" 2>/dev/null)"; then
        :
    else
        local venv="$XIRANG_ROOT/.venv"
        if [ ! -x "$venv/bin/python" ]; then
            _xr_log "no python3 with torch: creating $venv"
            python3 -m venv "$venv" || { _xr_log "python3 -m venv failed (on Debian: apt-get install python3-venv)"; return 1; }
            "$venv/bin/python" -m pip install --quiet --upgrade pip >&2 || true
        fi
        if ! out="$("$venv/bin/python" -c "$probe" 2>/dev/null)"; then
            _xr_log "installing torch==$torch_version into $venv (one time; large download)"
            "$venv/bin/python" -m pip install "torch==$torch_version" >&2 || { _xr_log "installing torch failed"; return 1; }
            out="$("$venv/bin/python" -c "$probe")" || return 1
        fi
    fi
    PY="$(printf '%s\n' "$out" | sed -n 1p)"
    local tv
    tv="$(printf '%s\n' "$out" | sed -n 2p)"
    export PY
    _xr_log "python: $PY (torch $tv)"

    # A constraint that keeps every later install from touching torch.
    mkdir -p "$XIRANG_ROOT/build"
    XIRANG_CONSTRAINT="$XIRANG_ROOT/build/torch-constraint.txt"
    echo "torch==$tv" > "$XIRANG_CONSTRAINT"
    export XIRANG_CONSTRAINT

    # 2. Python dependencies: what the demo and tests import, and what building xirang without
    #    build isolation needs (setuptools >= 77 for pyproject.toml's SPDX `license` string, and
    #    it has bdist_wheel built in; ninja for a parallel build).
    export PATH="$(dirname "$PY"):$PATH"    # a venv's ninja and console scripts
    local missing=()
    # shellcheck disable=SC2207
    missing=($("$PY" - <<'PYEOF'
import importlib.util, shutil
for mod, pkg in (("numpy", "numpy"), ("sklearn", "scikit-learn"), ("tqdm", "tqdm"), ("pytest", "pytest")):
    if importlib.util.find_spec(mod) is None:
        print(pkg)
try:
    import setuptools
    v = tuple(int(x) for x in setuptools.__version__.split(".")[:2])
except Exception:
    v = (0, 0)
if v < (77, 0):
    print("setuptools>=77")
if shutil.which("ninja") is None:
    print("ninja")
PYEOF
    ))
    if [ ${#missing[@]} -gt 0 ]; then
        _xr_log "installing ${missing[*]}"
        "$PY" -m pip install --quiet -c "$XIRANG_CONSTRAINT" "${missing[@]}" >&2 \
            || _xr_log "warning: installing ${missing[*]} failed"
    fi

    # 3. xirang itself.
    XIRANG_AVAILABLE=0
    XIRANG_BUILD_ERROR=""
    if [ ! -f "$XIRANG_ROOT/setup.py" ] && [ ! -f "$XIRANG_ROOT/pyproject.toml" ]; then
        XIRANG_BUILD_ERROR="no setup.py or pyproject.toml at $XIRANG_ROOT: xirang cannot be built yet"
    elif [ "${XIRANG_SKIP_BUILD:-0}" = 1 ]; then
        XIRANG_BUILD_ERROR="XIRANG_SKIP_BUILD=1"
    else
        local stamp="$XIRANG_ROOT/build/.xirang-install-stamp" hash
        # Sources, build files, the python and the torch they build against (not what the
        # build itself writes: _build_info.py, *.egg-info/).
        hash="$(
            cd "$XIRANG_ROOT" && {
                echo "$PY $tv"
                find csrc python setup.py pyproject.toml setup.cfg CMakeLists.txt MANIFEST.in \
                    -type f \( -name '*.py' -o -name '*.h' -o -name '*.hpp' -o -name '*.cc' \
                    -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' -o -name '*.txt' \
                    -o -name '*.toml' -o -name '*.cfg' -o -name '*.in' \) \
                    ! -name '_build_info.py' ! -path '*.egg-info/*' 2>/dev/null \
                    | LC_ALL=C sort | xargs -r sha256sum
            } | sha256sum | cut -d' ' -f1
        )"
        # The stamp's second word says whether that build ran with -Werror (XIRANG_WERROR=1, as
        # tests/run.sh asks): a -Werror build also satisfies a plain request, not the other way.
        local werror=0 have_hash="" have_werror=0
        case "${XIRANG_WERROR:-}" in 1|true|yes|on) werror=1 ;; esac
        if [ -f "$stamp" ]; then read -r have_hash have_werror < "$stamp" || true; fi
        if [ "${XIRANG_FORCE_REBUILD:-0}" != 1 ] && [ "$have_hash" = "$hash" ] \
            && [ "${have_werror:-0}" = 1 -o "$werror" = 0 ] \
            && (cd /tmp && "$PY" -c 'import xirang') >/dev/null 2>&1; then
            _xr_log "xirang is installed and up to date (stamp $stamp)"
        else
            _xr_log "building and installing xirang (pip install --no-build-isolation .$([ "$werror" = 1 ] && echo ', -Werror'))"
            rm -f "$stamp"
            if (cd "$XIRANG_ROOT" && XIRANG_WERROR=$werror "$PY" -m pip install --no-build-isolation --no-deps \
                    -c "$XIRANG_CONSTRAINT" . >&2); then
                echo "$hash $werror" > "$stamp"
            else
                XIRANG_BUILD_ERROR="pip install --no-build-isolation . failed (see the output above)"
            fi
        fi
        if [ -z "$XIRANG_BUILD_ERROR" ]; then
            local err
            # From /tmp, so the installed package is imported, not python/ in the work tree.
            if err="$(cd /tmp && "$PY" -c 'import xirang' 2>&1)"; then
                XIRANG_AVAILABLE=1
            else
                XIRANG_BUILD_ERROR="import xirang failed after install: $(printf '%s' "$err" | tail -n 1)"
                rm -f "$stamp"
            fi
        fi
    fi
    export XIRANG_AVAILABLE XIRANG_BUILD_ERROR
    if [ "$XIRANG_AVAILABLE" = 1 ]; then
        _xr_log "xirang: available"
    else
        _xr_log "xirang: NOT available: $XIRANG_BUILD_ERROR"
    fi
    return 0
}

_xr_setup
