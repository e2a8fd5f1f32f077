"""``cleanroom serve``: a sandbox server that unmodified E2B SDKs talk to (docs/server.md).

Modules: ``control`` (the sandboxes, each a session; E2B's control API), ``envd`` (process
and filesystem services), ``keys`` (hashed API keys, per-key limits), ``app`` (the ASGI
routes), ``serving`` (hypercorn, signals), ``cli`` (``cleanroom serve``, ``cleanroom keys``).
"""
