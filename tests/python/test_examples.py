"""The examples run: examples/train.py (and benchmarks/train_compare.py over it) under torchrun with
2 ranks, and the ecosystem examples.

Each case is parametrised over ``backend`` by conftest.py: "gloo" runs with DDP's own allreduce
(hook none), "xirang" with xirang's process group and the bf16 error-feedback hook; the xirang cases
are skipped while ``import xirang`` fails (a failure under XIRANG_TEST_REQUIRE=1).

Lightning and Accelerate are installed on demand with a constraint pinning the torch already present
(they must never upgrade torch under a built xirang); a case is skipped with the reason if the
install fails (no network, no wheel for this torch). Every subprocess has a timeout.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

pytestmark = pytest.mark.dedicated  # these spawn their own processes (torchrun), no pool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EX = os.path.join(ROOT, "examples")
COMPARE = os.path.join(ROOT, "benchmarks", "train_compare.py")  # the gloo-vs-xirang harness over train.py
TIMEOUT = int(os.environ.get("XIRANG_EXAMPLE_TIMEOUT", "300"))
HOOK = {"gloo": "none", "xirang": "bf16-ef"}


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def torchrun(script: str, *args: str, nproc: int = 2, timeout: int = TIMEOUT,
             check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", os.path.join(EX, script), *args]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n--- stdout\n{e.stdout}\n--- stderr\n{e.stderr}")
    if check and p.returncode != 0:
        pytest.fail(f"rc={p.returncode}: {' '.join(cmd)}\n--- stdout\n{p.stdout[-6000:]}\n"
                    f"--- stderr\n{p.stderr[-6000:]}")
    return p


def _train_args(backend: str, steps: int = 20) -> list:
    return ["--backend", backend, "--hook", HOOK[backend], "--steps", str(steps),
            "--warmup-steps", "2", "--no-progress"]


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------------
# examples/train.py
# ------------------------------------------------------------------------------------------------
def test_train_digits(backend, tmp_path):
    summary = tmp_path / "summary.json"
    stats = tmp_path / "stats"
    torchrun("train.py", *_train_args(backend, steps=30), "--summary", str(summary),
             "--stats-dir", str(stats))
    s = _read(str(summary))
    assert s["world_size"] == 2 and s["steps_run"] == 30 and s["layers"] == 26
    assert s["final_loss"] < 1.5, s          # starts at ln(10) = 2.30
    assert s["heldout_accuracy"] > 0.6, s
    assert s["step_time_s"] > 0
    name = {"gloo": "gloo", "xirang": "xirang+bf16-ef"}[backend]
    assert (stats / f"{name}.steps.rank1.json").exists()
    if backend == "gloo":
        assert s["bytes_wire_per_step"] == pytest.approx(s["gradient_bytes"])  # 2(N-1)/N = 1 at N=2
    elif s["hook_path"] == "local":  # one host's shared memory: DDP's fp32 buckets averaged in place
        assert s["bytes_wire_per_step"] == pytest.approx(s["gradient_bytes"]), s
    elif s["bytes_wire_per_step"] is not None:  # the hook reports it: bf16 halves the matrices
        assert s["bytes_wire_per_step"] < 0.75 * s["gradient_bytes"], s


def test_train_compare_table(backend, tmp_path):
    """benchmarks/train_compare.py: two trainings of examples/train.py in one torchrun job
    (destroy + fresh group), one table on rank 0."""
    summary = tmp_path / "summary.json"
    other = "gloo:none" if backend == "gloo" else "xirang:bf16-ef"
    p = torchrun(COMPARE, "--compare-with", other, "--steps", "20",
                 "--warmup-steps", "2", "--probe-steps", "2", "--no-progress",
                 "--summary", str(summary))
    for row in ("final loss (mean of last 20 steps)", "held-out accuracy", "step time",
                "bytes on the wire per step", "exposed comm per step", "not a speed claim"):
        assert row in p.stdout, p.stdout
    s = _read(str(summary))
    a, b = s["runs"]
    assert (a["backend"], a["hook"]) == ("gloo", "none")
    if backend == "gloo":
        # same seed, same configuration, fresh group: bitwise the same training
        assert a["final_loss"] == b["final_loss"] and a["heldout_accuracy"] == b["heldout_accuracy"]
        assert s["comparison"]["loss_within_tolerance"] and s["comparison"]["accuracy_within_1pt"]
    else:
        assert abs(a["final_loss"] - b["final_loss"]) < 0.2, s


@pytest.mark.slow
def test_train_resume_is_bitwise(backend, tmp_path):
    """5 steps, save, resume in new processes, 5 more == 10 uninterrupted steps (CPU, bitwise)."""
    common = _train_args(backend, steps=10)
    torchrun("train.py", *common, "--save", str(tmp_path / "full"))
    torchrun("train.py", *common, "--stop-at", "5", "--save", str(tmp_path / "half"))
    torchrun("train.py", *common, "--resume", str(tmp_path / "half"), "--save", str(tmp_path / "resumed"))
    for r in (0, 1):
        full = torch.load(tmp_path / "full" / f"rank{r}.pt", weights_only=False)
        res = torch.load(tmp_path / "resumed" / f"rank{r}.pt", weights_only=False)
        assert full["step"] == res["step"] == 10
        assert full["losses"] == res["losses"]
        for k, v in full["model"].items():
            assert torch.equal(v, res["model"][k]), k
        if backend == "xirang":
            assert res["hook_state"] is not None


def test_train_text_default_corpus_and_user_data(tmp_path):
    """The text task on the stdlib corpus and on --data, shrunk (4 blocks, 4 steps) to stay quick."""
    small = ["--backend", "gloo", "--hook", "none", "--task", "text", "--depth", "4",
             "--steps", "4", "--warmup-steps", "1", "--no-progress"]
    s1 = tmp_path / "s1.json"
    torchrun("train.py", *small, "--summary", str(s1))
    r = _read(str(s1))
    assert r["task"] == "text" and 1.0 < r["heldout_perplexity"] < 300.0, r
    user = tmp_path / "corpus.txt"
    user.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    s2 = tmp_path / "s2.json"
    torchrun("train.py", *small, "--data", str(user), "--summary", str(s2))
    assert _read(str(s2))["heldout_perplexity"] < 300.0


@pytest.mark.parametrize("script,args,msg", [
    ("examples/train.py", ["--batch-size", "0"], "--batch-size must be >= 1"),
    ("examples/train.py", ["--lr", "nan"], "--lr and --bucket-cap-mb must be finite and > 0"),
    ("examples/train.py", ["--layers-per-group", "0"], "--layers-per-group must be >= 1"),
    ("benchmarks/allreduce.py", ["--iters", "-3"], "--iters and --warmup must be >= 0"),
    ("benchmarks/allreduce.py", ["--sizes", "bogus"], "--sizes 'bogus': expected 'LO-HI' or a list"),
    ("benchmarks/allreduce.py", ["--sizes", "inf"], "--sizes 'inf': expected 'LO-HI' or a list"),
    ("benchmarks/allreduce.py", ["--ws", "2,x"], "--ws '2,x': expected world sizes"),
    ("benchmarks/allreduce.py", ["--op-timeout", "inf"], "--timeout and --op-timeout must be > 0 seconds"),
    # auto's calibration (DDP's first step + CALIBRATION_STEPS + the step applying the choice)
    ("benchmarks/ddp_step.py", ["--configs", "xirang_hook_auto", "--warmup", "7"], "--warmup must be >= 8 with"),
    ("benchmarks/topology.py", ["--sweep-groups", "5", "--sweep-warmup", "7"], "--sweep-warmup must be >= 8"),
])
def test_bad_arguments_are_usage_errors(script, args, msg):
    """Found by a new user: train.py --batch-size 0 died in the first step with an IndexError, and
    allreduce.py --iters -3 printed negative times and bandwidths (exit 0), --sizes bogus a
    traceback. Each is now argparse's usage error (exit 2) before any rank starts."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert msg in p.stderr, p.stderr[-2000:]


def test_train_xirang_missing_is_a_clear_error():
    spec_ok = subprocess.run([sys.executable, "-c", "import xirang"], cwd=tempfile.gettempdir(),
                             capture_output=True).returncode == 0
    if spec_ok:
        pytest.skip("xirang is importable here: nothing to check")
    p = torchrun("train.py", "--backend", "xirang", "--steps", "2", "--no-progress", check=False,
                 timeout=120)
    assert p.returncode != 0
    assert "pip install --no-build-isolation ." in p.stderr, p.stderr[-3000:]


# ------------------------------------------------------------------------------------------------
# Ecosystem examples
# ------------------------------------------------------------------------------------------------
def _ensure(module: str, package: str) -> None:
    """Import ``module`` or pip-install ``package`` pinned to the present torch; skip on failure."""
    if importlib.util.find_spec(module) is not None:
        return
    constraint = os.environ.get("XIRANG_CONSTRAINT")
    if not constraint or not os.path.isfile(constraint):
        fd, constraint = tempfile.mkstemp(prefix="torch-pin-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(f"torch=={torch.__version__}\n")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "-c", constraint, package]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip(f"installing {package} timed out")
    importlib.invalidate_caches()
    if p.returncode != 0 or importlib.util.find_spec(module) is None:
        pytest.skip(f"cannot install {package} with torch=={torch.__version__} pinned: "
                    f"{(p.stderr or p.stdout).strip().splitlines()[-1:] or 'unknown error'}")
    # the pin must have held
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                         capture_output=True, text=True, timeout=120).stdout.strip()
    assert out == torch.__version__, f"installing {package} changed torch to {out}"


@pytest.fixture(scope="module")
def lightning_installed():
    _ensure("lightning", "lightning")


@pytest.fixture(scope="module")
def accelerate_installed():
    _ensure("accelerate", "accelerate")


def test_lightning_example(backend, lightning_installed, tmp_path):
    summary = tmp_path / "summary.json"
    torchrun("lightning_example.py", "--backend", backend, "--hook", HOOK[backend], "--steps", "30",
             "--no-progress", "--summary", str(summary))
    s = _read(str(summary))
    assert s["world_size"] == 2 and s["steps"] == 30, s
    assert s["val_acc"] > 0.6, s
    if backend == "xirang":
        assert "hook_totals" in s


def test_accelerate_example(backend, accelerate_installed, tmp_path):
    summary = tmp_path / "summary.json"
    torchrun("accelerate_example.py", "--backend", backend, "--hook", HOOK[backend], "--steps", "30",
             "--summary", str(summary))
    s = _read(str(summary))
    assert s["world_size"] == 2 and s["model_is_ddp"], s
    assert s["process_group_backend"] == backend, s
    assert s["heldout_accuracy"] > 0.6, s
