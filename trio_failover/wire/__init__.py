"""HTTP/1 and streams: h11 framing, node connections and sockets, no policy."""
