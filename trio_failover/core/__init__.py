"""Pure decisions of the proxy: plain data in, plain data out, standard library only."""
