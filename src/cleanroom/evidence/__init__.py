"""What an episode leaves, and how anyone can check it: manifests, result records, provenance,
export, secrets and redaction; signed attestations (``attest``, ``statements``), the key that
signs them (``keys``) and the run's seal (``seal``). The verifier is ``cleanroom.checks.audit``."""
