"""Evidence anyone can verify: signed attestations (``attest``, ``statements``) and the key
that signs them (``keys``). The verifier is ``cleanroom.checks.audit``."""

from cleanroom.evidence.attest import open_envelope, sign
from cleanroom.evidence.keys import signing_key

__all__ = ["open_envelope", "sign", "signing_key"]
