"""Run ownership: the writer lease of a run and the fencing of every write on it.

A run has at most one writer at a time. A writer (a trainer) takes the run's lease with a holder id
and gets a generation; each later write carries `X-Run-Lease: <holder>:<generation>`. Fencing is
checked under the run's row lock, in the write's own transaction, so a holder that was taken over
cannot slip a write in after the take-over:

* live lease: only the holder's current generation writes (and the write extends the lease);
* no live lease (never taken, released or expired): writes without the header are accepted
  (clients that do not use leases), the last holder's own header as well, any other header is stale.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncSession

from exgrpo_client import schemas as s
from exgrpo_pool.errors import BadRequest, Conflict, NotFound
from exgrpo_pool.service.context import Context
from exgrpo_pool.store import repo
from exgrpo_pool.store.models import AnyLease, LeaseRow, Pool, PoolRow, Run, RunLease, RunRow, utcnow


@dataclass(frozen=True, slots=True)
class LeaseClaim:
    """What a write's `X-Run-Lease` header claims."""

    holder: str
    generation: int

    def __str__(self) -> str:
        return f"{self.holder}:{self.generation}"


def parse_lease_header(value: str | None) -> LeaseClaim | None:
    if value is None:
        return None
    holder, sep, gen = value.strip().rpartition(":")
    if not sep or not holder or len(holder) > 200 or not gen.isdigit() or int(gen) < 1:
        raise BadRequest(
            f"{s.LEASE_HEADER} must be '<holder>:<generation>' as answered by PUT .../runs/<run>/lease "
            f"(holder 1-200 characters, generation a positive integer), got {value[:250]!r}"
        )
    return LeaseClaim(holder, int(gen))


async def require_run(session: AsyncSession, pool: Pool, name: str, *, lock: bool = False) -> Run:
    run = await repo.get_run(session, pool.id, name, lock=lock)
    if run is None:
        raise _no_run(pool.name, name)
    return run


def _no_run(pool_name: str, run_name: str) -> NotFound:
    return NotFound(
        f"run {run_name!r} does not exist in pool {pool_name!r}; create it with POST "
        f"/v1/pools/{pool_name}/runs"
    )


def _live(lease: AnyLease | None, now: datetime) -> bool:
    return lease is not None and lease.expires_at > now


def _held_by(run_name: str, lease: AnyLease, now: datetime) -> str:
    left = (lease.expires_at - now).total_seconds()
    return (
        f"run {run_name!r} is held by {lease.holder!r} (lease generation {lease.generation}, "
        f"expires at {lease.expires_at.isoformat()}, in {left:.0f} s)"
    )


_HOW = (
    "wait for the lease to expire (resume) or take it over (PUT .../runs/{run}/lease with "
    "takeover=true), which fences out the current holder"
)


async def check_fence(
    session: AsyncSession, run_id: int, run_name: str, lease: LeaseRow | None, claim: LeaseClaim | None
) -> None:
    """Refuse a write on a run that its lease (`lease`, read under the run's row lock, which the
    caller holds) does not allow; the holder's write extends its live lease."""
    now = utcnow()
    how = _HOW.format(run=run_name)
    if claim is None:
        if lease is not None and _live(lease, now):
            raise Conflict(
                f"{_held_by(run_name, lease, now)}; this write carries no {s.LEASE_HEADER} header. Send the "
                f"holder's header, {how}"
            )
        return
    if lease is None:
        raise Conflict(
            f"{s.LEASE_HEADER} {claim} names a lease run {run_name!r} never had; take the lease with "
            f"PUT .../runs/{run_name}/lease first"
        )
    if (claim.holder, claim.generation) == (lease.holder, lease.generation):
        if _live(lease, now):
            lease.expires_at = now + timedelta(seconds=lease.ttl_s)
            await repo.extend_lease(session, run_id, lease.expires_at)
        return
    if _live(lease, now):
        raise Conflict(f"lease {claim} is fenced out: {_held_by(run_name, lease, now)}; {how}")
    raise Conflict(
        f"lease {claim} is stale: run {run_name!r} was since leased to {lease.holder!r} with generation "
        f"{lease.generation} (no longer live); take the lease again with PUT .../runs/{run_name}/lease"
    )


async def refuse_if_held(session: AsyncSession, run: Run, what: str) -> None:
    """Refuse to `what` while someone holds a live lease of the run (the caller may force it)."""
    lease = await repo.get_lease_row(session, run.id)
    now = utcnow()
    if lease is not None and _live(lease, now):
        raise Conflict(
            f"{_held_by(run.name, lease, now)}: {what} once the lease is released or expired, or now "
            "with force=true (the holder's next write then fails)"
        )


async def run_for_write(session: AsyncSession, pool: Pool, name: str, claim: LeaseClaim | None) -> Run:
    """The run, row-locked for the caller's transaction, once its lease allows this write."""
    run = await require_run(session, pool, name, lock=True)
    await check_fence(session, run.id, run.name, await repo.get_lease_row(session, run.id), claim)
    return run


async def missing_run(session: repo.Target, pool_name: str, run_name: str) -> NotFound:
    """The 404 of a pool or run that `repo.run_rows` did not find."""
    if not await repo.pool_exists(session, pool_name):
        return missing_pool(pool_name)
    return _no_run(pool_name, run_name)


def missing_pool(name: str) -> NotFound:
    return NotFound(f"pool {name!r} does not exist; list pools with GET /v1/pools or create it")


async def read_run(session: repo.Target, pool_name: str, run_name: str) -> tuple[PoolRow, RunRow]:
    """The pool and the run as plain rows, in one statement (a read)."""
    found = await repo.run_rows(session, pool_name, run_name)
    if found is None:
        raise await missing_run(session, pool_name, run_name)
    return found[0], found[1]


async def lock_run(
    session: AsyncSession, pool_name: str, run_name: str, claim: LeaseClaim | None
) -> tuple[PoolRow, RunRow]:
    """The pool and the run as plain rows, the run row-locked for the caller's transaction, once
    its lease allows this write (the pool, the run and the lease in one statement on SQLite, two
    on Postgres)."""
    found = await repo.run_rows(session, pool_name, run_name, lock=True, lease=True)
    if found is None:
        raise await missing_run(session, pool_name, run_name)
    pool, run, lease = found
    await check_fence(session, run.id, run.name, lease, claim)
    return pool, run


def _public(lease: RunLease, run: Run, pool: Pool) -> s.RunLease:
    return s.RunLease(
        run=run.name,
        holder=lease.holder,
        generation=lease.generation,
        expires_at=lease.expires_at,
        pool=pool.name,
    )


async def acquire(ctx: Context, pool: Pool, run_name: str, req: s.RunLeaseRequest) -> s.RunLease:
    async with ctx.db.write() as session:
        run = await require_run(session, pool, run_name, lock=True)
        lease = await repo.get_lease(session, run.id)
        now = utcnow()
        expires = now + timedelta(seconds=req.ttl_s)
        if req.generation is not None and (
            lease is None or (lease.holder, lease.generation) != (req.holder, req.generation)
        ):
            since = (
                "nobody ever held it"
                if lease is None
                else (
                    f"it was since leased to {lease.holder!r} with generation {lease.generation}"
                    f" ({'live' if _live(lease, now) else 'no longer live'})"
                )
            )
            raise Conflict(
                f"lease {req.holder}:{req.generation} of run {run.name!r} cannot be renewed: {since}"
            )
        if lease is None:
            lease = RunLease(
                run_id=run.id,
                holder=req.holder,
                generation=1,
                ttl_s=req.ttl_s,
                expires_at=expires,
                acquired_at=now,
            )
            session.add(lease)
        elif _live(lease, now) and lease.holder == req.holder and not req.takeover:
            lease.expires_at, lease.ttl_s = expires, req.ttl_s  # renewal
        elif _live(lease, now) and not req.takeover:
            raise Conflict(
                f"{_held_by(run.name, lease, now)}; {req.holder!r} cannot take it: "
                f"{_HOW.format(run=run.name)}"
            )
        else:  # free (released or expired), or a take-over
            lease.holder, lease.generation, lease.ttl_s = req.holder, lease.generation + 1, req.ttl_s
            lease.expires_at, lease.acquired_at = expires, now
        return _public(lease, run, pool)


async def release(ctx: Context, pool: Pool, run_name: str, holder: str) -> None:
    async with ctx.db.write() as session:
        run = await require_run(session, pool, run_name, lock=True)
        lease = await repo.get_lease(session, run.id)
        if lease is None or lease.holder != holder:
            who = "nobody" if lease is None else repr(lease.holder)
            raise Conflict(
                f"{holder!r} does not hold run {run.name!r} (its lease was last held by {who}); "
                "only the holder releases a lease"
            )
        now = utcnow()
        if lease.expires_at > now:
            lease.expires_at = now
