"""Saving and restoring the hook's state: residuals (per rank, keyed by parameter name) and
counters, never the process group.

:class:`Checkpointing` is a mixin of :class:`~xirang.hooks.BF16ErrorFeedbackState`; it reads and
writes the state's ``residuals``, ``_slots``, ``_groups``, ``world_size``, ``ring_order`` and
counters, and its ``_init_runtime()`` when unpickled.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict

import torch

STATE_DICT_VERSION = 1


class Checkpointing:
    """``state_dict`` / ``load_state_dict`` and pickling of the hook's state."""

    def state_dict(self) -> Dict[str, Any]:
        """This rank's residuals (fqn -> fp32 tensor, cloned) and counters; no process group.

        Every rank saves its own. Keys: ``version``, ``world_size``, ``ring_order``,
        ``layers_per_group`` (the setting: an int, None or ``"auto"``), ``autogroup`` (with
        ``"auto"``, once chosen: ``{"layers_per_group": g, "predicted_exposed_comm_s",
        "alpha_s", "beta_s_per_byte", "predictions_s", "source"}``; else None),
        ``min_compress_numel``, ``error_feedback``, ``wire``, ``steps``, ``skipped_steps``,
        ``residuals``. A residual is the rounding error still owed to the sum, whatever the
        format that made it: loading one saved under another ``wire`` keeps the error-feedback
        invariant.
        """
        res = {k: v.detach().clone() for k, v in self.residuals.items()}
        if self._pending_residuals is not None and not res:
            res = {k: v.clone() for k, v in self._pending_residuals.items()}
        return {
            "version": STATE_DICT_VERSION,
            "world_size": self.world_size,
            "ring_order": list(self.ring_order) if self.ring_order is not None else None,
            "layers_per_group": self.layers_per_group,
            "autogroup": self._auto.to_dict() if self._auto is not None else None,
            "min_compress_numel": self.min_compress_numel,
            "error_feedback": self.error_feedback,
            "wire": self.wire,
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "residuals": res,
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore residuals and counters saved by :meth:`state_dict` on this rank.

        A different world size or ring order resets residuals to zero with a warning (a
        residual belongs to the hops its rank made). Residuals of parameters that are not
        compressed here are ignored with a warning; a shape mismatch raises ``ValueError``.
        Before the process group is known (no hook call yet, or an unpickled state) the
        residuals are kept and applied once it is. A ``layers_per_group="auto"`` state takes the
        saved choice (``autogroup``) and regroups to it without calibrating again; a state with a
        fixed size keeps its own (residuals are keyed by parameter name, so any grouping loads).

        Everything is checked before anything changes: ``TypeError`` for a state that is not a
        dict, counters that are not non-negative ints or a residual that is not a floating-point
        tensor; ``ValueError`` for another version, a residual with non-finite values (every later
        step would be non-finite: a residual only changes on a finite step) or one whose element
        count is not its parameter's.
        """
        if not isinstance(sd, dict):
            raise TypeError(f"load_state_dict: expected the dict state_dict() returns, got {type(sd).__name__}")
        if sd.get("version") != STATE_DICT_VERSION:
            raise ValueError(f"unsupported hook state_dict version {sd.get('version')!r}")
        counters = {}
        for key in ("steps", "skipped_steps"):
            v = sd.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise TypeError(f"load_state_dict: {key} must be an int >= 0, got {type(v).__name__} {v!r}")
            counters[key] = v
        residuals = sd.get("residuals", {})
        if not isinstance(residuals, dict):
            raise TypeError(f"load_state_dict: residuals must be a dict of name -> tensor, got {type(residuals).__name__}")
        residuals = dict(residuals)
        for fqn, t in residuals.items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(f"load_state_dict: residual for {fqn!r} must be a floating-point tensor, got "
                                f"{type(t).__name__}{'' if not isinstance(t, torch.Tensor) else ' ' + str(t.dtype)}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"load_state_dict: residual for {fqn!r} holds non-finite values (every later step "
                                 "would be non-finite and skipped)")
        self._check_residual_sizes(residuals)
        ag = sd.get("autogroup")
        if self._auto is not None and ag is not None:
            self._auto.restore(ag)
            if self._root is not None:
                self._build_groups(self._root, self._ddp, warn=False)
        self.steps, self.skipped_steps = counters["steps"], counters["skipped_steps"]
        meta = {"world_size": sd.get("world_size"), "ring_order": sd.get("ring_order")}
        if self.world_size is None:
            self._pending_meta, self._pending_residuals = meta, residuals
            return
        self._apply_loaded(meta, residuals)

    def _apply_loaded(self, meta: Dict[str, Any], residuals: Dict[str, torch.Tensor]) -> None:
        saved_ws, saved_ring = meta.get("world_size"), meta.get("ring_order")
        same = saved_ws is None or (
            saved_ws == self.world_size
            and (saved_ring is None or tuple(saved_ring) == tuple(self.ring_order or ()))
        )
        self._check_residual_sizes(residuals)  # before the zeroing below (a pending load is checked here)
        self._unsettled = None  # the loaded residuals replace whatever the last step left
        for g in self._groups:  # residuals restart at zero unless restored below
            if g.residual is not None:
                g.residual.zero_()
        if not same:
            warnings.warn(
                f"hook state saved with world size {saved_ws} / ring order {saved_ring}, "
                f"loaded with {self.world_size} / {list(self.ring_order or ())}: residuals reset "
                "to zero",
                UserWarning,
                stacklevel=3,
            )
            return
        unknown = self._put_residuals(residuals)
        if unknown:
            warnings.warn(
                f"ignored residuals of parameters not compressed by this state: {unknown[:5]}"
                + (" ..." if len(unknown) > 5 else ""),
                UserWarning,
                stacklevel=3,
            )

    def _check_residual_sizes(self, residuals: Dict[str, torch.Tensor]) -> None:
        """``ValueError`` for a residual of a compressed parameter whose element count is not the
        parameter's (names without a compressed slot here are :meth:`_put_residuals`' to ignore)."""
        by_fqn = {s.fqn: s for s in self._slots.values()}
        for fqn, t in residuals.items():
            s = by_fqn.get(fqn)
            if s is not None and s.kind == "ef" and t.numel() != s.numel:
                raise ValueError(f"residual for {fqn} has {t.numel()} elements, parameter has {s.numel}")

    def _put_residuals(self, residuals: Dict[str, torch.Tensor]) -> list:
        """Copy each ``fqn -> tensor`` residual into its parameter's slot of its group's residual
        (allocated as zeros if needed; sizes checked by :meth:`_check_residual_sizes`); returns
        the names that have no compressed slot here."""
        by_fqn = {s.fqn: s for s in self._slots.values()}
        unknown = []
        for fqn, t in residuals.items():
            s = by_fqn.get(fqn)
            if s is None or s.kind != "ef":
                unknown.append(fqn)
                continue
            g = s.group
            if g.residual is None:
                g.residual = torch.zeros(g.ef_numel, dtype=torch.float32, device=g.device)
            g.residual[s.offset : s.offset + s.numel].copy_(t.reshape(-1))
        self._residuals_dirty = True
        return unknown

    def __getstate__(self) -> Dict[str, Any]:
        return {
            "layers_per_group": self.layers_per_group,
            "min_compress_numel": self.min_compress_numel,
            "error_feedback": self.error_feedback,
            "wire": self.wire,
            "measure_readiness": self.measure_readiness,
            "early_launch": self.early_launch,
            "local_average": self.local_average,
            "auto_calibration_steps": self._auto.calibration_steps if self._auto is not None else None,
            "state_dict": self.state_dict(),
        }

    def __setstate__(self, d: Dict[str, Any]) -> None:
        """Unpickled states hold residuals and counters only: call ``bind`` with the model."""
        self.layers_per_group = d["layers_per_group"]
        self.min_compress_numel = d["min_compress_numel"]
        self.error_feedback = d["error_feedback"]
        self.wire = d.get("wire", "bf16")  # states pickled before fp16 / int8 existed
        self.measure_readiness = d["measure_readiness"]
        self.early_launch = d.get("early_launch", True)  # states pickled before early launch
        self.local_average = d.get("local_average", True)  # states pickled before it
        self._auto = None
        if self.layers_per_group == "auto":
            from .autogroup import CALIBRATION_STEPS, AutoGroup  # noqa: PLC0415

            self._auto = AutoGroup(d.get("auto_calibration_steps") or CALIBRATION_STEPS)
        self._user_layers = None
        self.process_group = None
        self._init_runtime()
        self.load_state_dict(d["state_dict"])
