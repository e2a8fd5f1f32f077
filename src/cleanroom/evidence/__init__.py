"""What an episode leaves: manifests, result records, provenance, export, secrets."""
