"""Pure decision modules: plain data in, decisions out; no Trio, no I/O, no clock."""
