"""The Linux kit both host-backed tiers share: cgroups, network namespaces, layered workspace
storage (and its loop devices), template roots, the seccomp filter, process I/O, the supervise
loop and ``HostBackedBackend``. A tier (``namespace``, ``gvisor``) keeps only how its commands
start; nothing here knows which tier it serves."""
