"""Group options and knobs: xirang.Options(timeout=timedelta), bad knob values, XIRANG_ELASTIC."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("xirang._C", reason="xirang._C not built")

PRELUDE = textwrap.dedent(
    """
    import datetime, tempfile, torch, torch.distributed as dist, xirang
    store = dist.FileStore(tempfile.mktemp(), 1)
    """
)


def _run(code, **env):
    e = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, env=e)


def test_options_timeout_accepts_timedelta_and_seconds():
    out = _run(
        """
        for t in (datetime.timedelta(seconds=5), 5.0):
            dist.init_process_group("xirang", store=dist.PrefixStore(str(t), store), rank=0, world_size=1,
                                    pg_options=xirang.Options(timeout=t))
            x = torch.ones(3); dist.all_reduce(x); assert x.tolist() == [1.0, 1.0, 1.0]
            dist.destroy_process_group()
        print("OK")
        """
    )
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize("knob,value,pattern", [
    ("XIRANG_SEGMENT_BYTES", "0", "XIRANG_SEGMENT_BYTES=0 is too small"),
    ("XIRANG_SEGMENT_BYTES", "abc", "XIRANG_SEGMENT_BYTES='abc' is not an integer"),
    ("XIRANG_ALGO", "bogus", "must be auto, ring, direct or two_level"),
    ("XIRANG_ELASTIC", "maybe", "XIRANG_ELASTIC must be 0 or 1"),
    ("XIRANG_HEARTBEAT_S", "0", "XIRANG_HEARTBEAT_S must be > 0"),
])
def test_bad_knobs_fail_group_creation_clearly(knob, value, pattern):
    out = _run(
        """
        try:
            dist.init_process_group("xirang", store=store, rank=0, world_size=1)
        except Exception as e:
            print("ERROR", type(e).__name__, e)
        """,
        **{knob: value},
    )
    assert "ERROR" in out.stdout and pattern in out.stdout, (out.stdout[-2000:], out.stderr[-2000:])
