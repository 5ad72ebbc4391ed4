"""The plumbing every benchmark shares: the server it starts, the load it sends, the
adapters it makes, the report it writes."""
