"""`loraplex demo`: small LoRA adapters trained on the bundled model, demo tenants with
keys, and the server with all of it, on the embedded defaults."""
