"""The floor: host paths, private files, digests, host builds, processes, jails, cgroups."""
