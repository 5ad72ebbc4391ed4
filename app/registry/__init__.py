"""The adapter registry: uploaded archives checked and unpacked (archive), stored by
content (store), recorded as numbered versions (records), validated and registered by
the engine, kept in step on every replica (sync); AdapterRegistry (service) ties them."""
