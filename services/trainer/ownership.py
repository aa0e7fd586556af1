"""Run ownership on the trainer's side: the run's writer lease on the pool service.

A run has one writer at a time. At attach the trainer takes the run's lease under a holder id of
its own (host, process id and a random suffix); the SDK client then sends the lease with every
write of the run (plan, commit, policy versions, metrics), and the service refuses writes of
anyone else. A background thread renews the lease every third of its time to live; `close()`
gives it back. A trainer whose lease was taken over (`run.takeover` of another trainer) is fenced
out: its next write is refused, it raises `RunOwnershipError` and stops without writing a
checkpoint.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time

from exgrpo_client import Client
from exgrpo_client import schemas as s
from exgrpo_client.errors import Conflict, ExgrpoError

log = logging.getLogger("exgrpo.trainer")

EXIT_STATUS = 3
"""Exit status of a trainer that stops because another trainer owns its run."""


class RunOwnershipError(RuntimeError):
    """Another trainer owns the run: refused at attach, or taken over while training."""


def new_holder_id() -> str:
    """A holder id unique to this process: `<host>-<pid>-<random>`."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class RunLeaseKeeper:
    """Rank 0's hold on the run's writer lease: `acquire()`, renewal in the background, `check()`
    after a refused write, `close()`."""

    def __init__(
        self,
        client: Client,
        pool: str,
        run: str,
        *,
        ttl_s: float,
        takeover: bool = False,
        wait_s: float = 0.0,
        holder: str | None = None,
    ) -> None:
        self.client, self.pool, self.run = client, pool, run
        self.ttl_s, self.takeover, self.wait_s = ttl_s, takeover, wait_s
        self.holder = holder or new_holder_id()
        self.lease: s.RunLease | None = None
        self.lost: str | None = None
        """Why the lease is lost (the service's answer), once it is."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        return f"run {self.run} of pool {self.pool}"

    # ---------------------------------------------------------------------------- attach
    def acquire(self) -> s.RunLease:
        """Take the lease (waiting up to `wait_s` for another holder's to expire), make the
        client send it, and start renewing it. Raises `RunOwnershipError` if it stays taken."""
        deadline = time.monotonic() + self.wait_s
        waited = False
        while True:
            try:
                lease = self.client.acquire_run_lease(
                    self.pool, self.run, self.holder, ttl_s=self.ttl_s, takeover=self.takeover
                )
                break
            except Conflict as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RunOwnershipError(
                        f"{self.name} is owned by another trainer: {e.detail}. This trainer "
                        f"({self.holder}) does not write to it. Wait until the other trainer stops "
                        "(its lease expires run.lease_ttl_s after its last renewal; starting again "
                        "then resumes the run, and run.lease_wait_s=SECONDS waits for that), or take "
                        "the run over with `exgrpo train ... --takeover` (run.takeover=true), which "
                        "stops the other trainer at its next write"
                    ) from None
                if not waited:
                    log.info(
                        "%s is owned by another trainer; waiting up to %.0f s: %s", self.name, left, e.detail
                    )
                    waited = True
                time.sleep(min(2.0, max(0.1, left)))
        self._use(lease)
        how = "took over" if self.takeover else "owns"
        log.info(
            "this trainer (%s) %s %s (lease generation %d)", self.holder, how, self.name, lease.generation
        )
        self._thread = threading.Thread(target=self._renew_loop, name="exgrpo-run-lease", daemon=True)
        self._thread.start()
        return lease

    def _use(self, lease: s.RunLease) -> None:
        self.lease = lease
        self.client.use_run_lease(lease)

    # ----------------------------------------------------------------------------- renewal
    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            if not self.renew():
                return

    def renew(self, refusal: str | None = None) -> bool:
        """Extend the lease; False once it is lost (to a take-over). A failure to reach the
        service is logged and retried at the next renewal. `refusal`: the service's answer to a
        refused write, which says why when the lease turns out lost."""
        if self.lost is not None:
            return False  # never taken again once lost
        try:
            lease = self.client.acquire_run_lease(
                self.pool,
                self.run,
                self.holder,
                ttl_s=self.ttl_s,
                generation=self.lease.generation if self.lease is not None else None,
            )
        except Conflict as e:
            self._lose(e.detail)
            return False
        except Exception as e:  # the service unreachable, or answering oddly: try again later
            log.warning(
                "renewing the lease of %s failed (tried again in %.0f s): %s", self.name, self.ttl_s / 3, e
            )
            return True
        before = self.lease.generation if self.lease is not None else lease.generation
        if lease.generation > before + 1:
            # it had expired, and another trainer held the run in between: that one's writes
            # came after this trainer's, so this one must not go on
            self._lose(
                refusal
                or f"its lease had expired and {self.name} was held by another trainer since "
                f"(generations {before + 1}-{lease.generation - 1})"
            )
            self._give_back()
            return False
        if lease.generation != before:
            log.warning(
                "the lease of %s had expired; nobody took it, this trainer holds it again (generation %d)",
                self.name,
                lease.generation,
            )
        self._use(lease)
        return True

    def _lose(self, detail: str) -> None:
        if self.lost is None:
            self.lost = detail
            log.error("this trainer (%s) lost %s: %s", self.holder, self.name, detail)

    # ------------------------------------------------------------------------ refused writes
    def check(self, refusal: Conflict) -> bool:
        """After a write of the run was refused with 409: raises `RunOwnershipError` when the lease
        is lost; True when this trainer had to take its (expired) lease again, so the write may
        be repeated once; False when the lease is fine and the refusal was about something else."""
        before = self.lease.generation if self.lease is not None else None
        if self.lost is None:
            self.renew(refusal.detail)
        self.raise_if_lost()
        return self.lease is not None and self.lease.generation != before

    def raise_if_lost(self) -> None:
        if self.lost is not None:
            raise RunOwnershipError(
                f"this trainer ({self.holder}) no longer owns {self.name}: {self.lost}. It stops "
                "here without a checkpoint; the run goes on with its new owner"
            )

    # ------------------------------------------------------------------------------ closing
    def close(self) -> None:
        """Stop renewing and give the lease back (unless it was lost)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.lease is None:
            return
        if self.lost is not None:
            self.client.use_run_lease(None)
        else:
            self._give_back()
        self.lease = None

    def _give_back(self) -> None:
        try:
            self.client.release_run_lease(self.pool, self.run, self.holder)
        except ExgrpoError as e:
            self.client.use_run_lease(None)
            log.warning("giving back the lease of %s failed (it expires on its own): %s", self.name, e)
