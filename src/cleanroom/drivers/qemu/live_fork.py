"""Fork of a live qemu env (a session's branches): saved into a snapshot, then it runs on.

The env must be a fork parent (``Forks.start_parent``: its guest RAM is a file mapped shared,
``forkable=True`` in ``session``). ``save_live`` then makes a snapshot the way ``Forks.save``
does for a group, except that the parent lives on:

    SNAPSHOT_PREPARE -> migrate the device state (``x-ignore-shared``: the VM stops at its end)
    -> copy the RAM file while the VM is stopped (sparse: only the pages the guest touched)
    -> ``cont``: the parent runs again -> RESEED it like a clone (its own id kept, fresh
    entropy, the clock: it lagged while stopped) -> freeze the copy and hash it (``seal``).

The parent goes on writing its own RAM file; the snapshot's copy is frozen and sealed exactly
as a group's (clones restore from it with ``Forks.clone``). The copy is the cost of a live
fork: one pass over the guest's touched RAM on the host's disk (``bench/results/session.txt``).
"""

from __future__ import annotations

import asyncio
import time

from cleanroom.drivers import snapshot
from cleanroom.drivers.base import Env, ForkSnapshot
from cleanroom.drivers.qemu import fork
from cleanroom.drivers.qemu.clone import reseed_again
from cleanroom.errors import DriverError, Unsupported


async def save_live(forks: fork.Forks, env: Env, snapshot_id: str) -> ForkSnapshot:
    """Snapshot the live fork parent ``env`` into ``snapshot_id``; ``env`` stays usable.
    ``Unsupported`` if it was not made forkable; DriverError if a step failed (the parent
    may then be unusable: the caller ends its episode)."""
    parent = forks.parents.get(env.env_id)
    live = forks.ctx.live.get(env.env_id)
    if parent is None or live is None:
        raise Unsupported(f"{env.env_id} was not created forkable (RAM in a shared file)")
    fork.check_agent(env)
    ram_folder, request = parent
    started = time.monotonic()
    try:
        path = await asyncio.to_thread(fork.make_folder, snapshot_id, request)
    except OSError as exc:
        raise DriverError(f"cannot make the snapshot folder: {exc}") from exc
    preparing = time.monotonic()
    await env.session.snapshot_prepare()
    saving = time.monotonic()
    try:
        save_s = await fork.save_state(live, path)
        copying = time.monotonic()
        ram = ram_folder / snapshot.RAM_FILE
        await asyncio.to_thread(fork.sparse_copy, ram, path / snapshot.RAM_FILE)
    finally:
        qmp = await live.open_qmp()  # the parent runs on, whether or not its snapshot was made
        await qmp.execute("cont")
    resumed = time.monotonic()
    rejoined = await reseed_again(env.env_id, env.session)
    rejoined_at = time.monotonic()
    facts = await forks.seal_saved(env, snapshot_id, resumed, save_s)
    facts.update(
        prepare_s=round(saving - preparing, 4),  # the guest agent readies its clones' RESEED
        rejoin_s=round(rejoined_at - resumed, 4),
        copy_s=round(resumed - copying, 4),
        paused_s=round(resumed - saving, 4),  # save + copy: the parent stood still
        fork_s=round(rejoined_at - started, 4),
        parent_reseeded=bool(rejoined.get("reseeded")),
    )
    return ForkSnapshot(snapshot_id, forks.ctx.config.name, None, path, facts)
