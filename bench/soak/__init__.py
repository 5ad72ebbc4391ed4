"""`loraplex bench soak`: minutes of mixed traffic, then whatever the server kept."""
