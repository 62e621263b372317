"""pytest wiring for the multi-process collective tests.

- Every test with a ``backend`` argument runs for "xirang" and for "gloo" (the reference),
  unless it is marked ``xirang_only``.
- "xirang" cases are skipped with reason "xirang._C not built" only when ``import xirang``
  fails with ImportError (checked once, in a child process, so a crashing import cannot take
  pytest down).  Set XIRANG_TEST_REQUIRE=1 (CI) to turn that skip into a failure.  Any other
  import failure is a test failure.
- The ``pool`` fixture hands out the session's long-lived pool for (backend, ws); dead or
  poisoned pools are replaced.  Tests are reordered by (backend, ws) so pools get reused.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mp_pool  # noqa: E402

BACKENDS = ("gloo", "xirang")
_XIRANG_STATUS = None


def xirang_status():
    """("ok"|"missing"|"broken", detail), computed once."""
    global _XIRANG_STATUS
    if _XIRANG_STATUS is None:
        code = (
            "import sys\n"
            "try:\n"
            "    import torch.distributed, xirang\n"
            "except ImportError as e:\n"
            "    print(repr(e)); sys.exit(10)\n"
        )
        try:
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            if p.returncode == 0:
                _XIRANG_STATUS = ("ok", "")
            elif p.returncode == 10:
                _XIRANG_STATUS = ("missing", p.stdout.strip())
            else:
                _XIRANG_STATUS = ("broken", f"rc={p.returncode}\n{p.stdout}\n{p.stderr}")
        except subprocess.TimeoutExpired:
            _XIRANG_STATUS = ("broken", "import xirang timed out")
    return _XIRANG_STATUS


def require_backend(backend: str) -> None:
    if backend != "xirang":
        return
    status, detail = xirang_status()
    if status == "missing":
        if os.environ.get("XIRANG_TEST_REQUIRE") == "1":
            pytest.fail(f"xirang required (XIRANG_TEST_REQUIRE=1) but import failed: {detail}")
        pytest.skip("xirang._C not built")
    if status == "broken":
        pytest.fail(f"import xirang failed (not an ImportError): {detail}")


def gpu_script_dry_run(script: str, out_dir, args, result: str, env=None, timeout: float = 120) -> tuple:
    """Runs tests/gpu/<script> OUT_DIR *args --cpu (a GPU check's dry run on CPU tensors) with
    OMP_NUM_THREADS=1 and `env` added; fails the test on a non-zero exit. Returns (its stdout, the
    JSON it wrote to OUT_DIR/<result>)."""
    import json

    require_backend("xirang")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, os.path.join(root, "tests", "gpu", script), str(out_dir), *map(str, args), "--cpu"]
    p = subprocess.run(cmd, cwd=str(out_dir), env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    with open(os.path.join(str(out_dir), result)) as f:
        return p.stdout, json.load(f)


def pytest_generate_tests(metafunc):
    explicit = any("backend" in str(m.args[0]) for m in metafunc.definition.iter_markers("parametrize"))
    if "backend" in metafunc.fixturenames and not explicit:
        if metafunc.definition.get_closest_marker("xirang_only"):
            backends = ["xirang"]
            if os.environ.get("XIRANG_TEST_XIRANG_ONLY_ON_GLOO") == "1":
                backends.append("gloo")  # harness development only: assertions are xirang's
        else:
            backends = list(BACKENDS)
        metafunc.parametrize("backend", backends, scope="function")


def _order_key(item):
    cs = getattr(item, "callspec", None)
    params = cs.params if cs else {}
    b = params.get("backend")
    ws = params.get("ws")
    dedicated = item.get_closest_marker("dedicated") is not None or ws is None
    return (BACKENDS.index(b) if b in BACKENDS else 9, 1 if dedicated else 0, ws or 0)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_order_key)  # stable: keeps file order within a (backend, ws) block


def pytest_configure(config):
    config.addinivalue_line("markers", "dedicated: spawns its own processes instead of using a pool")


@pytest.fixture(scope="session")
def pools():
    mgr = mp_pool.PoolManager(max_procs=int(os.environ.get("XIRANG_TEST_MAX_PROCS", "10")))
    yield mgr
    mgr.close_all()


@pytest.fixture(autouse=True)
def _backend_available(request):
    if "backend" in request.fixturenames:
        require_backend(request.getfixturevalue("backend"))


@pytest.fixture
def pool(pools, backend, ws):
    return pools.get(backend, ws)
