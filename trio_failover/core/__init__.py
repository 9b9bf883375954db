"""The pure core: decisions as plain functions of data and ``now``, no I/O."""
