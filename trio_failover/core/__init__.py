"""The pure core: decisions as plain functions of data and ``now``, no I/O.

Ranking, outcomes, cooldowns, slots, the configuration and the errors,
each tested as tables of cases. It imports the standard library and
``attrs`` only: no other folder, no Trio, h11, sockets or clock.
"""
