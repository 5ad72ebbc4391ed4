"""`loraplex bench serve`: open-loop streams at given rates, with latency percentiles,
goodput and the server's KV, queue and RSS."""
