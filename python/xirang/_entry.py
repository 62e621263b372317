"""Import-free registration: the `torch.backends` entry point and the backend creator.

`autoload()` runs inside every `import torch` (torch's device-backend autoload), so it must be
cheap, must not load xirang._C, and must never raise. It registers `create_backend`, a
pure-Python creator that imports the extension only when a "xirang" group is created.
"""
from __future__ import annotations

NAME = "xirang"


def register() -> bool:
    """Register backend "xirang" for devices cpu and cuda, once per process.

    Returns True if this call registered it, False if it was already registered.
    """
    import torch.distributed as dist

    if NAME in dist.Backend.backend_list:
        return False
    dist.Backend.register_backend(NAME, create_backend, extended_api=True, devices=["cpu", "cuda"])
    return True


def autoload() -> None:
    """Entry point in group `torch.backends`. Never raises."""
    try:
        import torch.distributed as dist

        if dist.is_available():
            register()
    except Exception:  # noqa: BLE001 - a failure here must not break `import torch`
        pass


def create_backend(dist_backend_opts, backend_options):
    """Creator called by torch.distributed (extended_api=True) for each xirang group.

    Loads xirang._C (checking the torch version it was built against) and returns a
    ProcessGroupXirang. Raises RuntimeError with rebuild instructions on a torch mismatch.
    """
    from xirang import _backend

    return _backend.create(dist_backend_opts, backend_options)
