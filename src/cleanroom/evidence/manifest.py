"""Episode manifests: the only input an episode gets.

A manifest file is JSON Lines, one manifest per line. The whole file is validated before
anything runs; every bad line is reported with its line number and the field at fault. A list
from the Python API (``Manifest`` objects or plain dicts) is validated the same way, each
problem named by its index (``coerce_manifests``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from cleanroom.core.limits import Limits
from cleanroom.errors import ManifestError
from cleanroom.evidence import header_budget, manifest_json
from cleanroom.host.digests import digest_of

EPISODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}\Z")


def _safe_id(value: str) -> str:
    """``value`` if it is a safe id (a folder name in the store); ValueError if not. The whole
    string must match: ``"x\\n"`` is refused (``$`` would match before a final newline)."""
    if not EPISODE_ID_RE.match(value):
        raise ValueError(
            "must be 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


class Policy(BaseModel):
    """Which policy produced the episode's actions, and its parameters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=200)
    version: str = Field(default="0", max_length=200)
    params: dict[str, Any] = Field(default_factory=dict)


class SecretRef(BaseModel):
    """A secret an episode needs, by name; its value comes from the controller's provider."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
    lifetime_s: float | None = Field(default=None, gt=0, description="removed from the guest after")


class VerifierRef(BaseModel):
    """A deterministic check that turns an episode's artifacts and result into a verdict.

    ``baseline``: the verifier's baseline (digest, unique prefix or built spec path; unset: the
    episode's own). ``command`` runs with the episode's evidence under
    ``$CLEANROOM_DIR/input/`` and writes ``$CLEANROOM_DIR/verdict.json``. By default it runs in
    a fresh env of its own (the episode cannot tamper with its check); ``in_env`` runs it in
    the episode's env before teardown.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    baseline: str | None = Field(default=None, min_length=1)
    command: list[str] = Field(min_length=1)
    in_env: bool = False
    timeout_s: float = Field(default=300.0, gt=0, le=24 * 3600)


class NetworkRequest(BaseModel):
    """The egress an episode asks for: a subset of its baseline's allowlist (see
    ``cleanroom.network.policy``). ``allow: []`` turns the network off for this episode."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow: list[str] = Field(default_factory=list)

    @field_validator("allow")
    @classmethod
    def _entries(cls, value: list[str]) -> list[str]:
        from cleanroom.network.policy import checked_allowlist

        return checked_allowlist(value)


class GroupSetup(BaseModel):
    """A command the group's warm env runs once, before any of its episodes (argv, in the guest).

    No secrets reach it: its result is shared by every episode of the group.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: list[str] = Field(min_length=1)
    timeout_s: float = Field(default=600.0, gt=0, le=24 * 3600)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None

    def digest(self) -> str:
        """A stable digest of the setup spec (part of each episode's provenance)."""
        return digest_of(self.model_dump(mode="json"))


class Group(BaseModel):
    """Episodes that share a setup step (e.g. one GRPO task, N rollouts): see ``groups.py``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    setup: GroupSetup

    @field_validator("id")
    @classmethod
    def _id_is_safe(cls, value: str) -> str:
        return _safe_id(value)


class Manifest(BaseModel):
    """One episode's unit of work."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    episode_id: str
    baseline: str | None = Field(default=None, description="baseline digest (sha256:...)")
    seed: int = Field(strict=True, ge=0, lt=2**63)  # "3" is refused, not read as 3
    policy: Policy
    task: dict[str, Any] = Field(default_factory=dict)
    limits: Limits = Field(default_factory=Limits)
    secrets: list[SecretRef] = Field(default_factory=list)
    network: NetworkRequest | None = None
    output: str | None = Field(default=None, description="store URL or folder override")
    verifier: VerifierRef | None = None
    group: Group | None = None

    @model_validator(mode="before")
    @classmethod
    def _plain_json(cls, data: Any) -> Any:
        """NaN, Infinity, over-deep nesting, unreadable integers: refused before anything else."""
        found = manifest_json.problem(data)
        if found is not None:
            raise PydanticCustomError("json_value", "{problem}", {"problem": str(found)})
        return data

    @model_validator(mode="after")
    def _fits_one_header(self) -> Manifest:
        """A manifest the guest agent cannot take (over ``header_budget.MANIFEST_MAX``) is
        refused now, not as ``env_crashed`` on every attempt."""
        found = header_budget.manifest_problem(self.guest_view())
        if found is not None:
            raise PydanticCustomError("json_value", "{problem}", {"problem": found})
        return self

    @field_validator("episode_id")
    @classmethod
    def _episode_id_is_safe(cls, value: str) -> str:
        return _safe_id(value)

    @field_validator("secrets", mode="before")
    @classmethod
    def _secret_names(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"name": v} if isinstance(v, str) else v for v in value]
        return value

    @field_validator("baseline")
    @classmethod
    def _baseline_is_digest(cls, value: str | None) -> str | None:
        if value is not None and not DIGEST_RE.match(value):
            raise ValueError("must be a full digest 'sha256:<64 hex>'")
        return value

    def digest(self) -> str:
        """A stable digest of this manifest's content (for provenance)."""
        data = self.model_dump(mode="json")
        for optional in ("verifier", "group"):
            if data.get(optional) is None:
                data.pop(optional, None)  # digests of manifests without one stay as they were
        return digest_of(data)

    def guest_view(self) -> dict[str, Any]:
        """What the guest sees at /run/cleanroom/manifest.json (no secret values, ever; not
        its verifier either: the episode has no business with its check)."""
        return self.model_dump(mode="json", exclude={"verifier"})


def describe(error: ValidationError) -> list[str]:
    """One ``field.path: message`` string per problem (never the input: it may be huge)."""
    out = []
    for item in error.errors(include_input=False):
        where = ".".join(str(p) for p in item["loc"])
        if item["type"] == "json_value" and not where:
            out.append(item["msg"])  # it starts with its own path
        else:
            out.append(f"{where or '(manifest)'}: {item['msg']}")
    return out


class _Checker:
    """Validates manifests one by one, collecting every problem with where it is and refusing
    a second use of an episode id."""

    def __init__(self) -> None:
        self.manifests: list[Manifest] = []
        self.problems: list[str] = []
        self.seen: dict[str, str] = {}

    def add(self, data: Any, where: str) -> None:
        if isinstance(data, Manifest):
            manifest = data
        elif not isinstance(data, dict):
            self.problems.append(f"{where}: must be a JSON object")
            return
        else:
            try:
                manifest = Manifest.model_validate(data)
            except ValidationError as exc:
                self.problems.extend(f"{where}: {p}" for p in describe(exc))
                return
        if manifest.episode_id in self.seen:
            self.problems.append(
                f"{where}: episode_id: {manifest.episode_id!r} already used "
                f"on {self.seen[manifest.episode_id]}"
            )
            return
        self.seen[manifest.episode_id] = where
        self.manifests.append(manifest)

    def result(self, source: str) -> list[Manifest]:
        problems = self.problems or group_problems(self.manifests, self.seen)
        if problems:
            raise ManifestError(f"{source}: {len(problems)} problem(s); nothing was run", problems)
        if not self.manifests:
            raise ManifestError(f"{source}: no manifests found")
        return self.manifests


def parse_manifests(text: str, source: str = "<manifests>") -> list[Manifest]:
    """Validate every line of a JSON Lines text; raise one ManifestError listing all problems."""
    checker = _Checker()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            data = manifest_json.loads_line(line)
        except manifest_json.JsonProblem as exc:
            checker.problems.append(f"line {number}: {exc}")
            continue
        except json.JSONDecodeError as exc:
            checker.problems.append(
                f"line {number}: not valid JSON ({exc.msg} at column {exc.colno})"
            )
            continue
        checker.add(data, f"line {number}")
    return checker.result(source)


def coerce_manifests(
    items: Iterable[Manifest | dict[str, Any]], source: str = "manifests"
) -> list[Manifest]:
    """``Manifest`` objects and plain dicts, validated like a file's lines (``item 3: seed: ...``,
    counted from 0); one ManifestError lists every problem."""
    checker = _Checker()
    for index, item in enumerate(items):
        checker.add(item, f"item {index}")
    return checker.result(source)


GROUP_MUST_AGREE = ("group", "baseline", "limits.vcpus", "limits.memory_mib")
"""What every manifest of one group must share: clones restore one warm env's devices."""


def group_problems(manifests: list[Manifest], places: dict[str, str] | None = None) -> list[str]:
    """Manifests of one group that disagree with its first one on ``GROUP_MUST_AGREE``
    (``places``: where each episode id came from, e.g. ``line 3``)."""

    def where(m: Manifest) -> str:
        return places[m.episode_id] if places else f"episode {m.episode_id!r}"

    def facts(m: Manifest) -> tuple[Any, ...]:
        return (m.group, m.baseline, m.limits.vcpus, m.limits.memory_mib)

    first: dict[str, Manifest] = {}
    problems = []
    for m in manifests:
        if m.group is None:
            continue
        lead = first.setdefault(m.group.id, m)
        pairs = zip(GROUP_MUST_AGREE, facts(lead), facts(m), strict=True)
        differ = [name for name, a, b in pairs if a != b]
        if differ:
            problems.append(
                f"{where(m)}: group {m.group.id!r}: {', '.join(differ)} differ(s) from "
                f"{where(lead)} (every episode of a group shares one setup and one machine)"
            )
    return problems


def check_groups(manifests: list[Manifest]) -> None:
    """Raise ManifestError if the manifests' groups disagree (see ``group_problems``)."""
    problems = group_problems(manifests)
    if problems:
        raise ManifestError(f"{len(problems)} problem(s) with groups; nothing was run", problems)


def load_manifests(path: Path) -> list[Manifest]:
    """Read and validate a manifest file (JSON Lines)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: cannot read ({exc})") from exc
    return parse_manifests(text, source=str(path))
