"""Who an image baseline's entrypoint and commands run as: its config's ``User``, resolved to
numbers at build time (``baseline/image_user.py``), and the argv of the static helper that
drops to it in the guest (``RUNAS_PATH``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RUNAS_PATH = "/opt/cleanroom/runas"
GUEST_ROOT = "/run/cleanroom"


@dataclass(frozen=True)
class RunAs:
    """Who the entrypoint and commands run as: numbers only (resolved at build time)."""

    user: str  # the image config's User, as written
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    def to_json(self) -> dict[str, Any]:
        return {
            "user": self.user,
            "uid": self.uid,
            "gid": self.gid,
            "groups": list(self.groups),
            "home": self.home,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunAs:
        return cls(
            user=str(data["user"]),
            uid=int(data["uid"]),
            gid=int(data["gid"]),
            groups=tuple(int(g) for g in data.get("groups", ())),
            home=str(data.get("home") or "/"),
        )

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run through the helper as this user."""
        groups = ",".join(map(str, self.groups)) or "-"
        return [RUNAS_PATH, str(self.uid), str(self.gid), groups, GUEST_ROOT, "--", *argv]
