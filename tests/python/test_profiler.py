"""torch.profiler shows xirang's ranges: xirang:all_reduce for collectives (named like gloo's) and
xirang:group<k> for the hook's layer groups (issues #2 and #7)."""
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist, xirang
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("xirang")
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(16)])
    ddp = DDP(m, bucket_cap_mb=0.01)
    xirang.register_comm_hook(ddp, layers_per_group=8)
    x = torch.randn(8, 64)
    for _ in range(2):
        ddp(x).sum().backward()
    with torch.profiler.profile() as prof:
        ddp(x).sum().backward()
        t = torch.ones(10)
        dist.all_reduce(t)
        dist.broadcast(t, 0)
    names = sorted({e.name for e in prof.events() if e.name.startswith("xirang")})
    import os, sys
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.txt"), "w") as f:
        f.write(",".join(names))
    dist.destroy_process_group()
    """
)


def test_profiler_ranges(tmp_path):
    pytest.importorskip("xirang._C", reason="xirang._C not built")
    script = tmp_path / "prof.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for r in range(2):
        names = set((tmp_path / f"rank{r}.txt").read_text().split(","))
        assert {"xirang:all_reduce", "xirang:broadcast", "xirang:group0", "xirang:group1"} <= names, names
