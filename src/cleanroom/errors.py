"""The one exception hierarchy of cleanroom.

Every error the package raises on purpose is a ``CleanroomError``; callers catch the branch they
can handle. Errors from the outside world (OSError, subprocess, sqlite3, pydantic) are mapped onto
this tree at the boundary that meets them, so nothing above a module sees a foreign exception.

    CleanroomError
    ├── ConfigError                 bad settings or environment (missing tool, bad CLEANROOM_HOME)
    │   └── PrivacyError            a home or runtime folder another user owns or can write
    ├── ManifestError               a manifest file or line that does not validate
    │   └── NetworkPolicyError      an egress allowlist that is malformed, widens its baseline's,
    │                               or cannot be enforced by the driver
    ├── BaselineError
    │   ├── SpecError               a baseline.toml that does not validate
    │   ├── BuildError              a step of the build failed (mmdebstrap, mkfs.erofs, kernel)
    │   │   └── ImageError          an image over a build limit, or hostile (names layer + limit)
    │   ├── BaselineNotFound        no baseline with that digest (or prefix) in the store
    │   ├── DriftError              a stored component no longer matches the digest
    │   └── TransferError           a baseline file (export/import) that is unreadable or lies
    ├── DriverError
    │   ├── LaunchError             the environment could not be created / never became ready
    │   ├── EnvCrashed              the environment died or went silent under us
    │   ├── DestroyError            the environment could not be confirmed absent
    │   └── SnapshotDrift           a saved snapshot's files no longer match their digest
    ├── GuestOperationError         one operation in a guest failed; the guest itself is fine
    │   ├── CommandFailed           ``ExecResult.check()``: a non-zero exit or a signal
    │   │   └── CommandTimeout      ...or the command ran past its ``timeout_s`` (group killed)
    │   ├── GuestFileNotFound       ``get``/``get_stream``/``get_tar`` of a path that is not there
    │   ├── UnknownUser             ``user=`` names nobody in the guest's /etc/passwd
    │   ├── GuestUnsafePath         a tar member the guest refused to unpack (escape, device)
    │   └── Unsupported             the env's agent lacks the feature (HELLO ``features``)
    ├── ProtocolError               a peer sent a malformed or oversized frame
    │   ├── FrameTooLarge           a frame over the negotiated maximum
    │   ├── QuotaExceeded           the episode's output quota is used up
    │   └── UnsafePath              an artifact name that would escape its folder
    ├── StoreError
    │   ├── ExportError             a durable write failed (disk full, permission, backend)
    │   └── RecordConflict          a second, different record for the same episode
    ├── LedgerError                 the ledger could not be read or written
    ├── RunConflict                 a run that cannot start as asked
    │   ├── RunLocked               another live controller holds the run
    │   └── BaselineChanged         a resume with another baseline, not asked for
    ├── VerifierError               a verifier could not produce a verdict (never an outcome)
    ├── SetupError                  a group's setup step failed (its episodes end infra_error)
    ├── SessionError                a session call that cannot be done as asked
    │   ├── SessionPathError        a path that is not a folder (upload_dir, download_dir, list)
    │   └── SessionClosed           a call after the session ended (closed, failed, timed out)
    │       └── SessionTimeout      its ``timeout_s`` or ``idle_timeout_s`` passed (a TimeoutError)
    ├── CheckError                  a check (isolation, repro) could not run to its end
    ├── EvidenceError               an attestation key or envelope that cannot be used
    │   └── SignatureError          an envelope whose signature no trusted key verifies
    └── GymError                    a cleanroom.gym env used wrongly (step before reset, closed)
        └── GymEnvError             the in-VM Gymnasium env raised or died (episode_error)
"""

from __future__ import annotations


class CleanroomError(Exception):
    """Base of every error raised on purpose by cleanroom."""


class ConfigError(CleanroomError):
    """Settings or the host environment are not usable."""


class PrivacyError(ConfigError):
    """A folder cleanroom keeps private (the home, the runtime folder) is owned by another
    user, writable by others, or not a real folder; ``path`` names it."""

    def __init__(self, path: object, why: str) -> None:
        self.path = path
        super().__init__(f"{path}: {why}; cleanroom keeps it private to its owner and refuses it")


class ManifestError(CleanroomError):
    """A manifest (or a line of a manifest file) does not validate.

    ``problems`` holds one human-readable string per bad line/field, e.g.
    ``"line 3: limits.timeout_s: Input should be greater than 0"``.
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        self.problems = problems or []
        detail = "\n".join(f"  {p}" for p in self.problems)
        super().__init__(f"{message}\n{detail}" if detail else message)


class NetworkPolicyError(ManifestError):
    """An egress allowlist entry that does not parse, a manifest asking for more network than
    its baseline allows, or a driver that cannot enforce an allowlist (refused before a run)."""


class BaselineError(CleanroomError):
    """Something is wrong with a baseline or its spec."""


class SpecError(BaselineError):
    """A baseline spec (baseline.toml) does not validate."""


class BuildError(BaselineError):
    """A step of the baseline build failed."""


class ImageError(BuildError):
    """An image the build refuses: over a limit (bytes, entries, path length, free space of the
    scratch) or malformed in a way only a hostile image is; the message names the layer and
    the limit."""


class BaselineNotFound(BaselineError):
    """No baseline with that digest exists in the local store."""


class DriftError(BaselineError):
    """A baseline's files no longer match its digest; ``drifted`` names them."""

    def __init__(self, digest: str, drifted: list[str]) -> None:
        self.digest = digest
        self.drifted = drifted
        super().__init__(f"baseline {digest} has drifted: {', '.join(drifted)}")


class TransferError(BaselineError):
    """A baseline export/import file is unreadable, or a file in it does not match its hash."""


class DriverError(CleanroomError):
    """A driver could not do what was asked of an environment."""


class LaunchError(DriverError):
    """An environment could not be created or never became ready. ``console``: what its guest
    printed until then, if it had a console (the attempt keeps it as ``logs/console.log``)."""

    def __init__(self, message: str, console: bytes | None = None) -> None:
        super().__init__(message)
        self.console = console


class EnvCrashed(DriverError):
    """An environment died, or its agent went silent, while in use."""


class DestroyError(DriverError):
    """An environment could not be confirmed absent within the cleanup window."""


class SnapshotDrift(DriverError):
    """A saved snapshot (a paused sandbox's) whose files no longer match the digest recorded
    when it was sealed; ``drifted`` names them. Nothing is restored from it."""

    def __init__(self, snapshot_id: str, drifted: list[str]) -> None:
        self.snapshot_id = snapshot_id
        self.drifted = drifted
        super().__init__(
            f"snapshot {snapshot_id} no longer matches its digest: {', '.join(drifted)}"
        )


class GuestOperationError(CleanroomError):
    """One operation in the guest failed (a missing file, an unknown user, a failed command);
    the guest kept to the protocol and the env stays usable (unlike ``ProtocolError``)."""


class CommandFailed(GuestOperationError):
    """A guest command exited non-zero or was killed; ``result`` is its ``ExecResult``."""

    def __init__(self, message: str, result: object = None) -> None:
        self.result = result
        super().__init__(message)


class CommandTimeout(CommandFailed):
    """A guest command ran past its ``timeout_s``; its process group was killed."""


class GuestFileNotFound(GuestOperationError):
    """A guest path to read (``get``, ``get_stream``, ``get_tar``) does not exist."""


class UnknownUser(GuestOperationError):
    """``user=`` names no user of the guest."""


class PortUnreachable(GuestOperationError):
    """A guest port could not be connected to (nothing listens there, or it did not answer)."""


class GuestUnsafePath(GuestOperationError):
    """The guest refused a tar member that would escape its folder or is a device node."""


class Unsupported(GuestOperationError):
    """The env's guest agent does not serve this (its HELLO's ``features`` lack it)."""


class ProtocolError(CleanroomError):
    """The agent channel carried something malformed."""


class FrameTooLarge(ProtocolError):
    """A frame larger than the allowed maximum."""


class QuotaExceeded(ProtocolError):
    """The episode sent more output than its quota allows."""


class UnsafePath(ProtocolError):
    """An artifact name that is absolute, contains '..', or otherwise escapes its folder."""


class StoreError(CleanroomError):
    """The durable store failed."""


class ExportError(StoreError):
    """A durable write failed; nothing is reported as durable."""


class RecordConflict(StoreError):
    """A different result record already exists for this episode."""


class LedgerError(CleanroomError):
    """The ledger could not be read or written."""


class RunConflict(CleanroomError):
    """A run cannot be started (or resumed) as asked."""


class RunLocked(RunConflict):
    """Another controller that is still alive holds the run; the message names it."""


class BaselineChanged(RunConflict):
    """A run is resumed with a baseline other than the one it started with (refused unless
    asked for explicitly: ``RunOptions(allow_baseline_change=True)``)."""


class VerifierError(CleanroomError):
    """A verifier crashed, timed out or wrote no valid verdict (recorded; the outcome stands)."""


class SetupError(CleanroomError):
    """A group's setup command failed (non-zero exit or timeout) in its warm env.

    ``stdout``/``stderr`` hold the command's output (kept as each episode's diagnostics).
    """

    def __init__(self, message: str, stdout: bytes = b"", stderr: bytes = b"") -> None:
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(message)


class SessionError(CleanroomError):
    """A session call that cannot be done as asked."""


class SessionPathError(SessionError):
    """A folder (here or in the guest) that is not one; the message names it."""


class SessionClosed(SessionError):
    """A session was used after it ended; the message says how it ended."""


class SessionTimeout(SessionClosed, TimeoutError):
    """A session ran past its ``timeout_s`` or sat idle past its ``idle_timeout_s``;
    ``limit`` names which (the record's error says it too)."""

    def __init__(self, message: str, limit: str) -> None:
        self.limit = limit
        super().__init__(message)


class CheckError(CleanroomError):
    """A check (``cleanroom check isolation`` / ``repro``) could not run to its end."""


class EvidenceError(CleanroomError):
    """An attestation key that cannot be read or made, or an envelope that does not parse."""


class SignatureError(EvidenceError):
    """A DSSE envelope whose signature no trusted key verifies (the message says which)."""


class GymError(CleanroomError):
    """A ``cleanroom.gym`` env used wrongly: a step before reset, a call after close."""


class GymEnvError(GymError):
    """The Gymnasium env inside the VM raised (its traceback is the message) or its process
    died; the episode ends ``episode_error`` and the next ``reset`` starts a fresh VM."""
