"""envd, E2B's in-sandbox daemon, served on the host over each sandbox's session:
``process`` and ``filesystem`` (Connect RPC), ``files`` (plain HTTP), ``routing`` (which
sandbox a request is for)."""
