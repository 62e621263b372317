"""GPU check: a xirang built with XIRANG_BUILD_CUDA=0 refuses CUDA tensors with a clear error.

Run with PYTHONPATH pointing at that build's python/ directory (tests/gpu/run_checks.sh does).
"""
import datetime

import torch
import torch.distributed as dist

import xirang
from xirang import _C

assert not _C.CUDA_BUILT and xirang.build_info()["cuda"] is None, f"not the CPU-only build: {xirang.__file__}"
dist.init_process_group("xirang", store=dist.HashStore(), rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=30))
try:
    dist.all_reduce(torch.ones(4, device="cuda"))
except Exception as e:  # noqa: BLE001
    print("error:", e)
    assert "CUDA path is not built" in str(e), e
    print("PASS nocuda: clear error for a CUDA tensor")
else:
    raise SystemExit("FAIL nocuda: no error for a CUDA tensor in a CPU-only build")
