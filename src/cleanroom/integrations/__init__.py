"""Optional integrations, each behind its extra and imported only when used (``ray/``)."""
