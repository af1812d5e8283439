"""When the federation groups synchronize: pure integer logic, no tensors, no processes.

Paper (arXiv 2609.20359, Sec. 3, Alg. 1): after every H-th optimizer step the groups
average their parameters. With fragments (Streaming DiLoCo, arXiv 2501.18512; torchft
0.2.0 ``DiLoCo``), the FSDP units are dealt into P fragments and one fragment syncs
every H/P steps, fragment k mod P at the k-th fragment sync: its exchange launches at
local step H/P - tau (tau = ``sync_delay``), a compressed exchange advances from its
all-to-all to its all-gather one step later (when that is before the apply), and the
result is applied at local step H/P. P = 1 and tau = 0 is the paper's blocking sync of
the whole model. A full sync (``end_training``) completes the fragment in flight and then
syncs every fragment at once.

:meth:`SyncSchedule.step` counts one optimizer step and returns the actions due after
it; the caller executes them and reports each completed event with :meth:`applied`
(a fragment sync) or :meth:`synced` (a full sync).
"""

from __future__ import annotations

from dataclasses import dataclass

LAUNCH, ADVANCE, APPLY, FULL = "launch", "advance", "apply", "full"


@dataclass
class SyncSchedule:
    """The sync schedule and its counters (a checkpoint's ``sync`` entry).

    Attributes:
        sync_every, num_fragments, sync_delay, fragment_update_alpha: H, P, tau, alpha
            (as FLConfig; H a multiple of P, 0 <= tau < H/P).
        active: False with one group: steps are counted, nothing syncs.
        local_step: optimizer steps since the last sync event.
        global_step: optimizer steps in all.
        num_syncs: completed sync events (fragment syncs and full syncs).
        num_fragment_syncs: k, fragment k mod P syncs next.
        in_sync: no step (and no alpha mix) since the last full sync: the groups are equal.
        inflight: the fragment whose exchange is in flight, or None.
    """

    sync_every: int
    num_fragments: int = 1
    sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    active: bool = True
    local_step: int = 0
    global_step: int = 0
    num_syncs: int = 0
    num_fragment_syncs: int = 0
    in_sync: bool = True
    inflight: int | None = None

    @property
    def period(self) -> int:
        """H/P, optimizer steps between two fragment syncs."""
        return self.sync_every // self.num_fragments

    @property
    def blocking(self) -> bool:
        """P == 1 and tau == 0: the paper's sync of the whole model, as a full sync."""
        return self.num_fragments == 1 and self.sync_delay == 0

    def step(self) -> list[tuple[str, int | None]]:
        """Count one optimizer step; return the actions due after it, in order:
        ``(LAUNCH, k)``, ``(ADVANCE, k)``, ``(APPLY, k)`` (launching first if fragment k is
        not in flight) or ``(FULL, None)`` (a full sync with ``fragment_update_alpha``)."""
        self.local_step += 1
        self.global_step += 1
        self.in_sync = False
        return self.actions()

    def actions(self) -> list[tuple[str, int | None]]:
        """The actions due after the step just counted, from the counters as they are now
        (:meth:`step` returns them; a group whose counters were replaced by a peer's during
        a heal asks again)."""
        if not self.active:
            return []
        k, tau, out = self.num_fragment_syncs % self.num_fragments, self.sync_delay, []
        if tau and self.local_step == self.period - tau:
            self.inflight = k
            out.append((LAUNCH, k))
        elif self.inflight is not None and self.local_step == self.period - tau + 1 < self.period:
            out.append((ADVANCE, self.inflight))
        if self.local_step >= self.period:
            out.append((FULL, None) if self.blocking else (APPLY, k))
        return out

    def due(self) -> bool:
        """True when the next optimizer step ends with a sync event."""
        return self.active and self.local_step + 1 >= self.period

    def applied(self) -> None:
        """A fragment sync (APPLY) completed."""
        self.inflight = None
        self.num_fragment_syncs += 1
        self._end(full=self.num_fragments == 1 and self.fragment_update_alpha == 0)

    def synced(self, alpha: float = 0.0) -> None:
        """A full sync completed; it applied the fragment in flight, if any. With
        ``alpha`` 0 the groups are equal afterwards."""
        if not self.active:
            self.local_step, self.in_sync = 0, True
            return
        if self.inflight is not None:
            self.inflight = None
            self.num_fragment_syncs += 1
        self._end(full=alpha == 0)

    def _end(self, full: bool) -> None:
        self.local_step = 0
        self.num_syncs += 1
        self.in_sync = self.in_sync or full

    def state_dict(self) -> dict:
        """The counters (JSON-able); ``inflight_fragment`` is the fragment in flight."""
        return {"local_step": self.local_step, "global_step": self.global_step, "num_syncs": self.num_syncs,
                "num_fragment_syncs": self.num_fragment_syncs, "in_sync": self.in_sync,
                "inflight_fragment": self.inflight}

    def load_state_dict(self, state: dict) -> None:
        """Inverse of :meth:`state_dict`."""
        self.local_step, self.global_step = int(state["local_step"]), int(state["global_step"])
        self.num_syncs, self.num_fragment_syncs = int(state["num_syncs"]), int(state.get("num_fragment_syncs", 0))
        self.in_sync = bool(state.get("in_sync", self.local_step == 0))
        fragment = state.get("inflight_fragment")
        self.inflight = None if fragment is None else int(fragment)
