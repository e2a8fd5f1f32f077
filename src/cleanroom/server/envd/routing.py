"""Which sandbox an envd request is for, and whether it may use it.

The SDK names the sandbox in the ``E2b-Sandbox-Id`` header (``E2B_SANDBOX_URL`` sends every
envd call to one URL); behind real DNS the host name ``{port}-{sandbox_id}.{domain}`` names it.
Every sandbox has an envd access token (given to its creator in the create / connect answer,
sent back by the SDK as ``X-Access-Token``); a missing or wrong token is answered exactly like
an unknown sandbox, so a client that is not the sandbox's cannot tell it exists.
"""

from __future__ import annotations

import base64
import hmac
import re
from collections.abc import Callable

from cleanroom.server.control import Sandbox, Sandboxes, SandboxNotFound

HOST_RE = re.compile(r"^(\d+)-([A-Za-z0-9]+)\.")

Header = Callable[[str], str | None]


def sandbox_of(sandboxes: Sandboxes, header: Header) -> Sandbox:
    """The live sandbox a request names and may use (else ``SandboxNotFound``)."""
    sid = header("e2b-sandbox-id")
    if not sid:
        m = HOST_RE.match(header("host") or "")
        sid = m.group(2) if m else None
    sbx = sandboxes.by_id.get(sid or "")
    token = header("x-access-token") or ""
    if sbx is None or not sbx.live or not hmac.compare_digest(token, sbx.access_token):
        raise SandboxNotFound(f"sandbox {sid!r} not found")
    return sbx


def user_of(header: Header, given: str | None = None) -> str | None:
    """The user a call runs as: ``given`` (a query's ``username``), else the Basic auth
    ``user:`` the SDK sends; None: the baseline's default."""
    if given:
        return given
    auth = header("authorization") or ""
    if auth.lower().startswith("basic "):
        try:
            name = base64.b64decode(auth[6:].strip()).decode().split(":", 1)[0]
        except (ValueError, UnicodeDecodeError):
            return None
        return name or None
    return None
