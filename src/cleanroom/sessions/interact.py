"""One session's block: provision its episode, hand the session out once, conclude it.

``interact(episode, idle_timeout_s, make)`` is shared by ``opening.session`` (a new session) and
``fork`` (each branch): whatever ends the block (the caller's exception, a limit, the guest's
failure, the session dropped unclosed), the session concludes with that outcome, its evidence
is exported, its env destroyed and confirmed absent, and only then is anything raised again.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from cleanroom.core.states import Failure, Outcome
from cleanroom.lifecycle.episode import Episode
from cleanroom.sessions.core import AsyncSession

ABANDONED = "the session was garbage-collected or left open at exit; destroyed"


@asynccontextmanager
async def interact(
    episode: Episode,
    idle_timeout_s: float | None,
    make: Callable[[Episode], AsyncSession] = AsyncSession,
) -> AsyncIterator[AsyncSession]:
    """Provision, yield the session once (``make``: a fork's branches are ``Branch``es),
    conclude it; raise what ended it (after the env is gone: the ``Episode`` block closes
    before anything is raised again)."""
    pending: BaseException | None = None
    try:
        async with episode:
            await episode.provision()
            sb = make(episode)
            sb.start_clocks(episode.limits.timeout_s, idle_timeout_s)
            try:
                yield sb
            except asyncio.CancelledError:
                sb.stop_clocks()
                if sb.expired is None or sb.owner is None:
                    episode.output = sb.output()  # the transcript, kept with the attempt
                    raise
                while sb.owner.uncancel() > 0:  # ours (sent again until it arrived)
                    pass
                await sb.conclude(Failure(Outcome.TIMEOUT, sb.timeout_error().args[0]))
                pending = sb.timeout_error()
            except GeneratorExit as exc:  # dropped without closing: the loop's finalizer closes it
                warnings.warn(
                    f"session {sb.episode_id}: {ABANDONED}", ResourceWarning, stacklevel=1
                )
                await sb.conclude(Failure(Outcome.CANCELLED, ABANDONED))
                pending = exc
            except BaseException as exc:
                sb.stop_clocks()
                if exc is not sb.guard.failed_by or sb.guard.failure is None:
                    episode.output = sb.output()
                    raise
                await sb.conclude(sb.guard.failure)  # the guest's outcome, with its transcript
                pending = exc
            else:
                await sb.conclude()
    finally:  # the attempt's staging is gone: its empty parents go too
        _drop_empty_parents(episode.staging)
    if pending is not None:
        raise pending


def _drop_empty_parents(staging: Path) -> None:
    """Remove ``staging/<run>/<episode>`` and ``staging/<run>`` if the attempt's folder was
    their last entry (a session is its run's only episode; a branch's run is its own)."""
    for folder in (staging.parent, staging.parent.parent):
        try:
            folder.rmdir()
        except OSError:  # not empty (another attempt or episode), or gone already
            return
